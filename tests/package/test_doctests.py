"""Every docstring example in the package runs (house rule 9)."""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import pkgutil

import pytest

import fullbatch

MODULES = sorted(
    info.name
    for info in pkgutil.walk_packages(fullbatch.__path__, prefix="fullbatch.")
    if not info.name.endswith("__main__")
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name: str) -> None:
    if name.startswith("fullbatch.trl") and importlib.util.find_spec("trl") is None:
        pytest.skip("needs TRL (pip install -e '.[trl]')")
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"

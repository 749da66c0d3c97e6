"""Every docstring example in the package runs (house rule 9)."""

from __future__ import annotations

import doctest
import importlib
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
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"

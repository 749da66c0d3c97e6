"""Every docstring example in the package runs (house rule 9)."""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import pkgutil
import sys

import pytest

import fullbatch

MODULES = sorted(
    info.name
    for info in pkgutil.walk_packages(fullbatch.__path__, prefix="fullbatch.")
    if not info.name.endswith("__main__")
)


@pytest.fixture(scope="module", autouse=True)
def _deepspeed_speaks_first() -> None:
    """DeepSpeed prints its accelerator on stdout at its first use in a process (the Trainer
    asks for it): let it print here, not inside whichever example comes first."""
    if importlib.util.find_spec("deepspeed") is not None:
        importlib.import_module("deepspeed.accelerator").get_accelerator()


def _forget(name: str) -> None:
    sys.modules.pop(name, None)
    vars(fullbatch).pop(name.rsplit(".", 1)[1], None)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(
    name: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    if name.startswith("fullbatch.trl") and importlib.util.find_spec("trl") is None:
        pytest.skip("needs TRL (pip install -e '.[trl]')")
    if name == "fullbatch.super_gradients" and importlib.util.find_spec("super_gradients") is None:
        # CI cannot install Super-Gradients: its examples run on the tests' stand-in
        from _super_gradients_standin import modules

        for module_name, standin in modules().items():
            monkeypatch.setitem(sys.modules, module_name, standin)
        request.addfinalizer(lambda: _forget(name))  # imported on the stand-in: forget it
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"

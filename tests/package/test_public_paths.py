"""Every public import path and name, imported as a user writes it (none moves in a release).

The list is written out here, not read from the modules: a name that disappears, or a module
whose path changes (``fullbatch.hf`` is a package over private modules), fails this test.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

import pytest

PUBLIC = {
    "fullbatch": [
        "Accumulator",
        "Pipeline",
        "PipelineLoss",
        "StepStats",
        "VerifyReport",
        "Window",
        "__version__",
        "causal_lm_loss",
        "count_tokens",
        "cross_entropy_sum",
        "moe",
        "probe",
        "row_windows",
        "scale_lr",
        "testing",
        "verify",
    ],
    "fullbatch.hf": ["LOSS_KINDS", "ExactTrainer", "LossFn", "TrainerCheck", "check_trainer"],
    "fullbatch.trl": ["ExactDPOTrainer", "ExactGRPOTrainer", "ExactSFTTrainer"],
    "fullbatch.lightning": ["ExactAccumulation"],
    "fullbatch.deepspeed": [
        "OFFLOAD_FIXED",
        "DeepSpeedWindow",
        "ExactEngine",
        "check_engine",
        "refusal",
    ],
    "fullbatch.super_gradients": ["ExactTrainer", "SummedLoss"],
    "fullbatch.composer": ["TokenCounts"],
    "fullbatch.moe": ["load_balancing", "router_counts"],
    "fullbatch.testing": ["assert_equivalent", "char_tokenizer", "tiny_causal_lm", "tiny_seq2seq"],
}
# What each path needs besides torch (skipped without it).
NEEDS = {
    "fullbatch.hf": "transformers",
    "fullbatch.trl": "trl",
    "fullbatch.lightning": "lightning",
    "fullbatch.deepspeed": "deepspeed",
}
# Reprs and pickles name the public path, whichever private file defines the class.
HOMES = {
    "fullbatch.Accumulator": "fullbatch",
    "fullbatch.Pipeline": "fullbatch",
    "fullbatch.PipelineLoss": "fullbatch",
    "fullbatch.hf.ExactTrainer": "fullbatch.hf",
}


def _import(path: str, monkeypatch: pytest.MonkeyPatch) -> object:
    need = NEEDS.get(path)
    if need is not None and importlib.util.find_spec(need) is None:
        pytest.skip(f"needs {need}")
    if path == "fullbatch.super_gradients" and importlib.util.find_spec("super_gradients") is None:
        from _super_gradients_standin import modules  # CI cannot install Super-Gradients

        for name, standin in modules().items():
            monkeypatch.setitem(sys.modules, name, standin)
        monkeypatch.delitem(sys.modules, path, raising=False)
    return importlib.import_module(path)


@pytest.mark.parametrize("path", sorted(PUBLIC))
def test_every_public_name_imports_from_its_path(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = _import(path, monkeypatch)
    assert sorted(module.__all__) == sorted(PUBLIC[path])
    for name in PUBLIC[path]:
        namespace: dict[str, object] = {}
        exec(f"from {path} import {name}", namespace)
        assert namespace[name] is getattr(module, name)
    if path == "fullbatch.super_gradients":
        sys.modules.pop(path, None)  # imported on the stand-in: forget it
        vars(importlib.import_module("fullbatch")).pop("super_gradients", None)


@pytest.mark.parametrize("public", sorted(HOMES))
def test_public_classes_name_their_public_home(
    public: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, name = public.rsplit(".", 1)
    cls = getattr(_import(path, monkeypatch), name)
    assert cls.__module__ == HOMES[public]

"""``fb.probe`` around TRL's ``SFTTrainer`` (fused LM head: the loss is computed outside the
model's forward): stock on Gemma 4 is flagged, ``fullbatch.trl.ExactSFTTrainer`` passes, each
judged against a plain full-batch gradient computed here from the first window's documents."""

from __future__ import annotations

import copy
import tempfile
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import fullbatch as fb

pytest.importorskip("trl")
from _trl_cases import Recording, config, dataset, documents
from fullbatch._demo._trl_tiny import char_tokenizer, has_gemma4, tiny_causal_lm

K, BATCH = 4, 1
pytestmark = pytest.mark.skipif(not has_gemma4(), reason="needs a transformers with Gemma 4")


def _train(exact: bool) -> dict[str, Any]:
    from transformers import TrainerCallback
    from trl import SFTTrainer

    from fullbatch.trl import ExactSFTTrainer

    first: dict[str, Any] = {}

    class Applied(TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if "grads" not in first:
                first["grads"] = {n: p.grad.clone() for n, p in kw["model"].named_parameters()}

    model = tiny_causal_lm("gemma4")
    start = copy.deepcopy(model)
    cls = ExactSFTTrainer if exact else SFTTrainer
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer: Any = cls(
            model=model, args=config(tmp, k=K, batch=BATCH), train_dataset=dataset("prompt", 2 * K),
            processing_class=char_tokenizer(), callbacks=[Applied()],
        )  # fmt: skip
        recording = Recording(trainer.data_collator)
        trainer.data_collator = recording
        with fb.probe(objective="causal_lm") as probe:
            trainer.train()
    rows = [r for micro in recording.seen[:K] for r in micro]
    return {"report": probe.report, "grads": first["grads"], "start": start, "rows": rows}


def _reference(start: torch.nn.Module, rows: list[dict]) -> dict[str, torch.Tensor]:
    """The window's documents right-padded into one batch, Σ -log p over its target tokens
    divided by their count, one backward."""
    docs = documents(rows)
    width = max(len(ids) for ids, _ in docs)
    ids = torch.tensor([d + [0] * (width - len(d)) for d, _ in docs])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in docs])
    mask = torch.tensor([[1] * len(d) + [0] * (width - len(d)) for d, _ in docs])
    logits = start(input_ids=ids, attention_mask=mask).logits[:, :-1]
    targets = labels[:, 1:]
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).backward()
    return {n: p.grad.clone() for n, p in start.named_parameters()}


def _rel(a: dict, b: dict) -> float:
    diff = sum(float((a[n].double() - b[n].double()).pow(2).sum()) for n in b)
    return (diff / sum(float(b[n].double().pow(2).sum()) for n in b)) ** 0.5


def test_stock_sft_trainer_on_gemma4_is_flagged() -> None:
    run = _train(exact=False)
    check = run["report"].windows[0]  # the first of the windows checked
    ref = _reference(run["start"], run["rows"])
    assert not run["report"].ok and check.engine == "trl.SFTTrainer"
    assert check.pattern == "mean of per-micro-batch means"
    assert "fullbatch.trl.ExactSFTTrainer" in check.diagnosis
    n = [sum(1 for t in r["labels"][1:] if t != -100) for r in run["rows"]]
    assert check.weights == pytest.approx([sum(n) / (K * c) for c in n], rel=1e-4)
    assert check.error == pytest.approx(_rel(run["grads"], ref), rel=1e-4)


def test_exact_sft_trainer_passes() -> None:
    run = _train(exact=True)
    assert run["report"].ok, str(run["report"])
    check = run["report"].windows[0]  # the first of the windows checked
    assert check.engine == "fullbatch.trl.ExactSFTTrainer" and check.micro_batches == K
    # TRL's fused LM head computes its log-probabilities in float32 tiles: on this float64 model
    # the trainer is exact up to float32 rounding; the probe replays that head as the trainer
    # called it, and its band shows that rounding.
    assert 1e-9 < check.band < 1e-5 and check.error <= check.tolerance
    assert _rel(run["grads"], _reference(run["start"], run["rows"])) < 1e-6

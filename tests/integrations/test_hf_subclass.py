"""Any Trainer subclass made exact: ``class Exact(fullbatch.hf.ExactTrainer, YourTrainer)`` with
``exact_loss`` holding what ``YourTrainer.compute_loss`` adds, as a sum and a count.

The subclass here adds a logit penalty ``λ · mean(logit²)`` over the target tokens to the
next-token loss; its exact form returns ``Σ (ce_t + λ · mean_v logit_tv²)`` and the target
count. One optimizer step over a window of 4 micro-batches equals a plain full batch written
here (float64 Gemma 4; its float32 attention sets the band: 1e-6 relative)."""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

import fullbatch.hf as fbhf
from _hf_cases import SmallCollator, small_rows, training_args
from fullbatch._demo._trl_tiny import has_gemma4, tiny_causal_lm

needs_gemma4 = pytest.mark.skipif(
    not has_gemma4(), reason="Gemma 4 is not in this transformers (it is in 5.x)"
)

LAMBDA = 0.05
TOL = 1e-6


def _penalized_terms(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, Any]:
    logits, targets = logits[:, :-1], labels[:, 1:]
    keep = targets != -100
    ce = F.cross_entropy(logits[keep], targets[keep], reduction="sum")
    penalty = logits[keep].pow(2).mean(-1).sum()
    return ce + LAMBDA * penalty, keep.sum()


def _classes() -> tuple[type, type]:
    from transformers import Trainer

    class Penalized(Trainer):
        """A user's Trainer: its compute_loss adds a term (a per-micro-batch mean)."""

        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, **k: Any):
            labels = inputs.pop("labels")
            outputs = model(**inputs)
            total, count = _penalized_terms(outputs.logits, labels)
            loss = total / count
            return (loss, outputs) if return_outputs else loss

    class ExactPenalized(fbhf.ExactTrainer, Penalized):
        def exact_loss(self, model: Any, inputs: Any) -> tuple[Any, Any]:
            inputs = dict(inputs)
            labels = inputs.pop("labels")
            return _penalized_terms(model(**inputs).logits, labels)

    return Penalized, ExactPenalized


def _step(cls: type, rows: list[Any], **kw: Any) -> dict[str, torch.Tensor]:
    model = tiny_causal_lm("gemma4")
    with tempfile.TemporaryDirectory() as tmp:
        trainer = cls(
            model=model,
            args=training_args(tmp, k=4, batch=2),
            train_dataset=rows,
            data_collator=SmallCollator("causal_lm"),
            **kw,
        )
        trainer.train()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@needs_gemma4
def test_subclass_step_equals_full_batch_and_the_plain_subclass_does_not() -> None:
    penalized, exact_penalized = _classes()
    rows = small_rows(8)  # one window: 4 micro-batches of 2 rows, varying lengths
    model = tiny_causal_lm("gemma4")
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = SmallCollator("causal_lm")(rows)
    labels = batch.pop("labels")
    total, count = _penalized_terms(model(**batch).logits, labels)
    (total / count).backward()
    ref = {n: p.detach() - 0.1 * p.grad for n, p in model.named_parameters()}
    moved = sum(float((ref[n] - init[n]).pow(2).sum()) for n in ref) ** 0.5

    def error(got: dict[str, torch.Tensor]) -> float:
        return sum(float((got[n] - ref[n]).pow(2).sum()) for n in ref) ** 0.5 / moved

    assert error(_step(exact_penalized, rows)) < TOL
    assert error(_step(penalized, rows)) > 1e-3  # the stock subclass: means over K


def test_forgetting_exact_loss_names_the_path() -> None:
    penalized, _ = _classes()

    class Forgot(fbhf.ExactTrainer, penalized):  # type: ignore[misc, valid-type]
        pass

    with tempfile.TemporaryDirectory() as tmp, pytest.raises(TypeError) as info:
        Forgot(model=tiny_causal_lm("llama"), args=training_args(tmp, k=2, batch=2),
               loss="causal_lm")  # fmt: skip
    message = str(info.value)
    assert "overrides compute_loss (in Penalized)" in message
    assert "exact_loss(self, model, inputs) -> (loss_sum, count)" in message


@needs_gemma4
def test_check_trainer_passes_the_exact_subclass() -> None:
    _, exact_penalized = _classes()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = exact_penalized(
            model=tiny_causal_lm("gemma4"),
            args=training_args(tmp, k=4, batch=2),
            data_collator=SmallCollator("causal_lm"),
        )
        check = fbhf.check_trainer(trainer, small_rows(8))
    assert check.passed, str(check)

"""``fullbatch.hf.check_trainer``: is a configured Hugging Face Trainer's accumulation exact?

It drives the Trainer's own per-window machinery (``get_batch_samples``, then ``training_step``
for each micro-batch with the sync flag the Trainer's loop would set) on a copy of the model,
twice from the same parameters: the rows of one window as ``K`` micro-batches, and the same
rows as one micro-batch (what ``gradient_accumulation_steps=1`` with a ``K`` times bigger batch
computes). The gradients the optimizer would receive are compared, and so are the losses the
Trainer would log. Nothing of the user's is changed: the model is copied, the Trainer's
attributes are restored, the RNG state is restored.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fullbatch._base._versions import get_batch_samples
from fullbatch._verify._arms import compare, grad_norm, relative
from fullbatch._verify._precision import TOLERANCES, dtype_name
from fullbatch._verify._report import GradientComparison, _fmt
from fullbatch._verify._state import disable_dropout

__all__ = ["TrainerCheck", "check_trainer"]


@dataclass(frozen=True)
class TrainerCheck:
    """What :func:`fullbatch.hf.check_trainer` found; ``str(check)`` is the readable report.

    Attributes:
        passed: the accumulated window's gradient (``‖Δ‖ / ‖ref‖`` over all tensors) and grad
            norm equal the full batch's within ``tolerance``, and its logged loss within
            ``max(tolerance, 1e-6)`` (the Trainer sums logged losses in float32). The worst single
            tensor's error is shown but not judged: a gradient that is zero in exact arithmetic
            (e.g. attention key biases) is pure rounding noise.
        reason: one line: why it passed or failed, and the fix when it failed.
        trainer: the Trainer's class name.
        accumulated: the accumulated window against the full batch (errors relative to it;
            ``loss`` is the loss the Trainer would log for the window).
        full_batch_loss: the loss the Trainer logs for the full batch; full_batch_grad_norm its
            gradient norm.
        tolerance: relative tolerance (by parameter dtype: float64 1e-10, float32 1e-5,
            bfloat16 2e-2, float16 2e-3; or ``rtol``).
        dtype: the parameters' dtype.
        rows, micro_batches: rows of the window and the micro-batches they were split into.
        notes: what the check changed on its copy (dropout) and other remarks.
    """

    passed: bool
    reason: str
    trainer: str
    accumulated: GradientComparison
    full_batch_loss: float
    full_batch_grad_norm: float
    tolerance: float
    dtype: str
    rows: int
    micro_batches: int
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        arm = self.accumulated
        lines = [
            f"fullbatch check_trainer: {'PASSED' if self.passed else 'FAILED'} ({self.trainer}, "
            f"{self.dtype}, tolerance {self.tolerance:.3g} relative)",
            f"window: {self.rows} rows as {self.micro_batches} micro-batches vs one full batch",
            f"  gradient error {_fmt(arm.global_rel_error)} (‖Δ‖/‖ref‖); grad norm "
            f"{arm.grad_norm:.6g} vs "
            f"{self.full_batch_grad_norm:.6g}; logged loss {arm.loss:.6g} vs "
            f"{self.full_batch_loss:.6g}",
            f"verdict: {self.reason}",
        ]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


#: The Trainer sums logged losses in a float32 tensor, so they are judged to this at best.
LOSS_TOL = 1e-6


def _error(arm: GradientComparison, tol: float) -> float:
    """The verdict's measure, in units of ``tol``: gradient, grad norm and logged loss errors."""
    errors = (
        arm.global_rel_error / tol,
        arm.grad_norm_rel_error / tol,
        arm.loss_rel_error / max(tol, LOSS_TOL),
    )
    return math.nan if any(math.isnan(e) for e in errors) else max(errors)


def _diagnose(arm: GradientComparison, ref_norm: float, k: int, tol: float, name: str) -> str:
    if _error(arm, tol) <= 1:
        return f"accumulating {k} micro-batches gives the full-batch step ({name})."
    fix = "use fullbatch.hf.ExactTrainer(..., loss=...) in place of the Trainer."
    ratio = arm.grad_norm / ref_norm if ref_norm > 0 else math.nan
    if abs(ratio - k) < 0.5 * k - 0.5:
        return (
            f"the accumulated gradient norm is {ratio:.2f}x the full batch's: each micro-batch's "
            "loss is a mean that the Trainer does not divide by gradient_accumulation_steps (a "
            f"head that accepts **kwargs but ignores num_items_in_batch); {fix}"
        )
    return (
        f"the accumulated gradient is {_fmt(arm.global_rel_error)} off the full batch's: "
        f"micro-batches are not weighted by their item counts; {fix}"
    )


def _rows_and_collator(
    trainer: Any, rows: Sequence[Any] | None, needed: int
) -> tuple[list[Any], Callable[[list[Any]], Any]]:
    """The rows to use and the collator, with unused columns removed as the Trainer's loader
    would (``datasets.Dataset`` columns, or the keys of plain rows)."""
    collate = trainer.data_collator
    data: Any = trainer.train_dataset if rows is None else rows
    if data is None:
        raise ValueError("the Trainer has no train_dataset; pass rows=[...] to check_trainer.")
    if hasattr(data, "column_names"):  # a datasets.Dataset
        data = trainer._remove_unused_columns(data, description="check_trainer")
    else:
        collate = trainer._get_collator_with_removed_columns(collate, description="check_trainer")
    if len(data) < needed:
        raise ValueError(
            f"check_trainer needs {needed} rows (gradient_accumulation_steps x "
            f"per_device_train_batch_size), got {len(data)}."
        )
    return [data[i] for i in range(needed)], collate


def _run_window(trainer: Any, model: torch.nn.Module, batches: list[Any]) -> tuple[dict, float]:
    """One window through the Trainer's own get_batch_samples and training_step."""
    for p in model.parameters():
        p.grad = None
    saved = dict(trainer.__dict__)
    state = trainer.accelerator.gradient_state
    sync = state.sync_gradients
    try:
        got, n_items = get_batch_samples(trainer, iter(batches), len(batches))
        trainer.current_gradient_accumulation_steps = len(got)
        logged = 0.0
        for i, micro in enumerate(got):
            state._set_sync_gradients(i == len(got) - 1)
            logged += float(trainer.training_step(model, micro, n_items))
    finally:
        state._set_sync_gradients(sync)
        trainer.__dict__.clear()
        trainer.__dict__.update(saved)
    grads = {
        name: None if p.grad is None else p.grad.detach().clone()
        for name, p in model.named_parameters()
    }
    return grads, logged


def check_trainer(
    trainer: Any,
    rows: Sequence[Any] | None = None,
    *,
    micro_batches: int | None = None,
    rtol: float | None = None,
) -> TrainerCheck:
    """Check that ``trainer``'s gradient accumulation gives the full-batch step.

    One window of ``micro_batches`` (default: ``args.gradient_accumulation_steps``) micro-batches
    of ``args.per_device_train_batch_size`` rows runs through the Trainer's own
    ``get_batch_samples`` and ``training_step``, and the same rows once more as one micro-batch
    (what ``gradient_accumulation_steps=1`` with a batch that many times bigger computes), both
    from the model's current parameters, on a deep copy with dropout switched off. The gradient
    the optimizer would receive (before clipping) and the loss the Trainer would log are
    compared. The model, its gradients, the Trainer's attributes and the RNG state are left as
    they were. Single process only.

    Args:
        trainer: a configured ``transformers.Trainer`` (stock, a subclass, or
            :class:`fullbatch.hf.ExactTrainer`).
        rows: the rows to use, as the data collator takes them (default: the first rows of
            ``trainer.train_dataset``).
        micro_batches: micro-batches in the window (at least 2).
        rtol: relative tolerance (default by parameter dtype: float64 1e-10, float32 1e-5).

    Returns:
        a :class:`TrainerCheck`; print it for the verdict.

    Raises:
        ValueError: fewer than 2 micro-batches, or fewer rows than one window needs.
        RuntimeError: called in a multi-process run.

    >>> import torch, tempfile
    >>> from transformers import BertConfig, BertForSequenceClassification, Trainer
    >>> from transformers import TrainingArguments
    >>> import fullbatch.hf
    >>> config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
    ...     num_attention_heads=2, intermediate_size=32, num_labels=3)
    >>> rows = [{"input_ids": torch.tensor([1, 2 + i % 7]), "labels": torch.tensor(i % 3)}
    ...     for i in range(8)]
    >>> args = TrainingArguments(tempfile.mkdtemp(), per_device_train_batch_size=2,
    ...     gradient_accumulation_steps=4, use_cpu=True, report_to=[], save_strategy="no")
    >>> stock = Trainer(model=BertForSequenceClassification(config), args=args)
    >>> fullbatch.hf.check_trainer(stock, rows).passed  # BERT drops num_items_in_batch
    False
    """
    k = micro_batches if micro_batches is not None else trainer.args.gradient_accumulation_steps
    if k < 2:
        raise ValueError(
            f"check_trainer needs at least 2 micro-batches to compare, got {k}; pass "
            "micro_batches=4 (or set gradient_accumulation_steps > 1)."
        )
    if trainer.accelerator.num_processes > 1:
        raise RuntimeError(
            "check_trainer compares one process's window; run it before launching with "
            "torchrun (a single process), e.g. in a notebook or a short script."
        )
    size = trainer.args.per_device_train_batch_size
    data, collate = _rows_and_collator(trainer, rows, k * size)
    micro = [collate(data[i * size : (i + 1) * size]) for i in range(k)]
    full = [collate(data)]

    model = copy.deepcopy(trainer.accelerator.unwrap_model(trainer.model)).train()
    changed = disable_dropout(model).describe()
    notes = [f"dropout switched off on the copy ({len(changed)} modules or attributes)"]
    notes = notes if changed else []
    dtype = next(model.parameters()).dtype
    tol = rtol if rtol is not None else TOLERANCES.get(dtype, 1e-5)
    with torch.random.fork_rng(devices=[]):
        ref, ref_loss = _run_window(trainer, model, full)
        got, got_loss = _run_window(trainer, model, micro)
    worst, worst_name, overall = compare(ref, got)
    ref_norm, got_norm = grad_norm(ref), grad_norm(got)
    arm = GradientComparison(
        recipe=f"{k} micro-batches",
        max_rel_error=worst,
        worst_tensor=worst_name,
        global_rel_error=overall,
        loss=got_loss,
        loss_rel_error=relative(got_loss, ref_loss),
        grad_norm=got_norm,
        grad_norm_rel_error=relative(got_norm, ref_norm),
    )
    name = type(trainer).__name__
    passed = _error(arm, tol) <= 1
    return TrainerCheck(
        passed=passed,
        reason=_diagnose(arm, ref_norm, k, tol, name),
        trainer=name,
        accumulated=arm,
        full_batch_loss=ref_loss,
        full_batch_grad_norm=ref_norm,
        tolerance=tol,
        dtype=dtype_name(dtype),
        rows=len(data),
        micro_batches=k,
        notes=notes,
    )

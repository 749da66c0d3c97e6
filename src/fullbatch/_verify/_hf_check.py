"""``fullbatch.hf.check_trainer``: is a configured Hugging Face Trainer's accumulation exact?

It drives the Trainer's own per-window machinery (``get_batch_samples``, then ``training_step``
for each micro-batch with the sync flag the Trainer's loop would set) on a copy of the model
that shares nothing with it (:func:`fullbatch._verify._isolate.isolated_copy`), three times from the
same parameters: the rows of one window as ``K`` micro-batches, the same rows as one micro-batch
(what ``gradient_accumulation_steps=1`` with a ``K`` times bigger batch computes), and twice more
for the rounding band: the full batch with its rows in another order, and the ``K``
micro-batches given the full batch's shape (right-padded, filled with rows whose labels are all
``-100``). Each pair is
mathematically equal whatever the Trainer does with the loss, so their distance is the
configured model's own rounding (float32 internals, kernels that change with the sequence
length), and the tolerance is a multiple of it. Nothing of the
user's is changed (model, gradients, Trainer attributes, RNG streams; checked on exit).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fullbatch._base._modelstate import disable_dropout
from fullbatch._base._moe import moe_aux_of
from fullbatch._proof._tolerance import BAND_CAP, tolerance
from fullbatch._verify._arms import compare, grad_norm, relative
from fullbatch._verify._isolate import Untouched, isolated_copy
from fullbatch._verify._precision import dtype_name
from fullbatch._verify._report import GradientComparison, _fmt

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
        tolerance: relative tolerance: ``rtol``, or ``BAND_FACTOR`` (4) times the measured
            ``band``, at least ``FLOOR_ULPS`` (16) units in the last place of the parameter dtype
            (:func:`fullbatch._proof._tolerance.tolerance`).
        band: the model's rounding band: how far the full batch moves when only its rows'
            order changes, or the window when only its micro-batches' shape does.
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
    band: float
    dtype: str
    rows: int
    micro_batches: int
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        arm = self.accumulated
        lines = [
            f"fullbatch check_trainer: {'PASSED' if self.passed else 'FAILED'} ({self.trainer}, "
            f"{self.dtype}, tolerance {self.tolerance:.3g} relative; rounding band "
            f"{self.band:.2g} measured)",
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


def _fix(trainer: Any) -> str:
    """The fix that fits this Trainer's class."""
    names = {c.__name__ for c in type(trainer).__mro__}
    cls = type(trainer).__name__
    if isinstance(getattr(trainer, "fullbatch_route", None), str):  # one of fullbatch's routes
        return (
            f"{cls} is fullbatch's, so its loss is at fault: loss= (or exact_loss) must return "
            "the micro-batch's loss summed over its items and that count, for this head"
        )
    for trl_name in ("SFTTrainer", "DPOTrainer", "GRPOTrainer"):
        if trl_name in names:
            return f"use fullbatch.trl.Exact{trl_name} in place of trl.{trl_name} (same arguments)"
    from transformers import Trainer

    if type(trainer).compute_loss is not Trainer.compute_loss:
        return (
            f"{cls} overrides compute_loss: subclass class Exact(fullbatch.hf.ExactTrainer, "
            f"{cls}) and override exact_loss(model, inputs) -> (loss_sum, count)"
        )
    return "use fullbatch.hf.ExactTrainer(..., loss=...) in place of the Trainer"


def _diagnose(
    arm: GradientComparison, ref_norm: float, k: int, tol: float, trainer: Any, routed: bool
) -> str:
    name = type(trainer).__name__
    if not ref_norm > 0 or not arm.grad_norm > 0:
        return (
            f"no gradient reached the parameters (grad norm {arm.grad_norm:.3g} accumulated, "
            f"{ref_norm:.3g} full batch): nothing was compared. Check that the model has "
            "trainable parameters and that the rows have labels."
        )
    if _error(arm, tol) <= 1:
        return f"accumulating {k} micro-batches gives the full-batch step ({name})."
    fix = _fix(trainer) + "."
    ratio = arm.grad_norm / ref_norm
    if abs(ratio - k) < 0.5 * k - 0.5:
        return (
            f"the accumulated gradient norm is {ratio:.2f}x the full batch's: each micro-batch's "
            "loss is a mean that the Trainer does not divide by gradient_accumulation_steps (a "
            f"head that accepts **kwargs but ignores num_items_in_batch); {fix}"
        )
    why = "micro-batches are not weighted by their item counts"
    if routed:
        why += (
            ", or the MoE load-balancing loss is each micro-batch's, not the window's (a window "
            "statistic taken per micro-batch: docs/moe.md)"
        )
    return (
        f"the accumulated gradient is {_fmt(arm.global_rel_error)} off the full batch's "
        f"(tolerance {tol:.2g}): {why}; {fix}"
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


def _widened(micro: list[Any], full: Any, routed: bool = False) -> list[Any] | None:
    """The micro-batches given the full batch's shape: right-padded to its width (masked
    positions, ``-100`` labels) and, unless the rows are coupled (DPO's ``[chosen; rejected]``
    halves) or ``routed`` (an MoE model's load-balancing loss counts every unmasked token, so a
    filler row would change it), filled up to its rows with copies of their first row whose
    labels are all ``-100``.
    Mathematically the same window, so its distance to the plain window is rounding from the
    shapes alone (e.g. a float32 attention whose kernel changes with them). ``None`` when the
    batches are not padded token batches with an ``attention_mask``."""
    if not all(isinstance(m, dict) and isinstance(m.get("attention_mask"), torch.Tensor)
               for m in [*micro, full]):  # fmt: skip
        return None
    full_rows, width = full["attention_mask"].shape[0], full["attention_mask"].shape[-1]
    coupled = "completion_mask" in full or routed
    out = []
    for m in micro:
        rows, n = m["attention_mask"].shape[0], m["attention_mask"].shape[-1]
        if m["attention_mask"].dim() != 2 or n > width:
            return None
        extra = 0 if coupled else max(full_rows - rows, 0)
        wide = dict(m)
        for key, value in m.items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != rows:
                continue
            ignored = key in ("labels", "shift_labels")
            if value.dim() == 2 and value.shape[1] == n:
                pad = value.new_full((rows, width - n), -100 if ignored else 0)
                value = torch.cat([value, pad], dim=1)
            if extra:
                filler = value[:1].expand(extra, *value.shape[1:])
                filler = torch.full_like(filler, -100) if ignored else filler
                value = torch.cat([value, filler], dim=0)
            wide[key] = value
        out.append(wide)
    return out


def _run_window(trainer: Any, model: torch.nn.Module, batches: list[Any]) -> tuple[dict, float]:
    """One window through the Trainer's own get_batch_samples and training_step."""
    for p in model.parameters():
        p.grad = None
    saved = dict(trainer.__dict__)
    state = trainer.accelerator.gradient_state
    sync = state.sync_gradients
    try:
        got, n_items = trainer.get_batch_samples(iter(batches), len(batches), trainer.args.device)
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
    compared. The same full batch with its rows in another order measures the model's own
    rounding band, which sets the tolerance. It never passes when no gradient reached the
    parameters. The model, its gradients, the Trainer's attributes and the RNG streams are left
    as they were (checked on exit). Single process only.

    Args:
        trainer: a configured ``transformers.Trainer`` (stock, a subclass, or
            :class:`fullbatch.hf.ExactTrainer`).
        rows: the rows to use, as the data collator takes them (default: the first rows of
            ``trainer.train_dataset``).
        micro_batches: micro-batches in the window (at least 2).
        rtol: relative tolerance (default: 4 times the measured rounding band, see
            :class:`TrainerCheck`).

    Returns:
        a :class:`TrainerCheck`; print it for the verdict.

    Raises:
        ValueError: fewer than 2 micro-batches, or fewer rows than one window needs.
        RuntimeError: called in a multi-process run; the check wrote to the model itself
            (something patched onto it still calls the original; gradients are restored).

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
    shuffled = [collate(data[1:] + data[:1])]  # the same rows, another order
    user_model = trainer.accelerator.unwrap_model(trainer.model)
    routed = moe_aux_of(user_model) is not None
    widened = _widened(micro, full[0], routed)  # the micro-batches shaped as the full batch
    with Untouched(trainer, user_model), torch.random.fork_rng(devices=[]):
        model = isolated_copy(user_model).train()
        changed = disable_dropout(model).describe()
        ref, ref_loss = _run_window(trainer, model, full)
        alt, alt_loss = _run_window(trainer, model, shuffled)
        got, got_loss = _run_window(trainer, model, micro)
        wide, wide_loss = _run_window(trainer, model, widened) if widened else (got, got_loss)
        del model
    notes = [f"dropout switched off on the copy ({len(changed)} modules or attributes)"]
    notes = notes if changed else []
    if routed:
        notes.append(
            "the model adds a router load-balancing loss (router_aux_loss_coef): the full batch's "
            "is the whole window's; the band's micro-batches are padded to the full batch's "
            "width but not filled with rows (a filler row would be routed)"
        )
    dtype = next(user_model.parameters()).dtype
    worst, worst_name, overall = compare(ref, got)
    ref_norm, got_norm = grad_norm(ref), grad_norm(got)
    band = max(
        compare(ref, alt)[2],
        relative(grad_norm(alt), ref_norm),
        relative(alt_loss, ref_loss) if abs(ref_loss) > 0 else 0.0,
        compare(got, wide)[2],
        relative(wide_loss, got_loss) if abs(got_loss) > 0 else 0.0,
    )
    if not widened:
        notes.append(
            "the micro-batches carry no attention_mask, so the band was measured by reordering "
            "rows only (kernels that switch with the sequence length are not covered)"
        )
    tol = rtol if rtol is not None else tolerance(band, dtype)
    if not band <= BAND_CAP:
        notes.append(
            f"the full batch with its rows reordered moved by {band:.3g}: that is no rounding "
            "(the model is random, not finite, or its rows interact), so the tolerance is "
            f"{tol:.3g} (pass rtol= to choose it)"
        )
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
    passed = ref_norm > 0 and got_norm > 0 and _error(arm, tol) <= 1
    return TrainerCheck(
        passed=passed,
        reason=_diagnose(arm, ref_norm, k, tol, trainer, routed),
        trainer=type(trainer).__name__,
        accumulated=arm,
        full_batch_loss=ref_loss,
        full_batch_grad_norm=ref_norm,
        tolerance=tol,
        band=band,
        dtype=dtype_name(dtype),
        rows=len(data),
        micro_batches=k,
        notes=notes,
    )

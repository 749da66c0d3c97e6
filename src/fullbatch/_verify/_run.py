"""``fb.verify``: prove, on the user's own model and batch, that fullbatch equals the full batch.

Three gradients from the same parameters: the plain full-batch reference (``loss_sum / count``,
one backward), one window of the real :class:`fullbatch.Accumulator`, and the naive recipe
(each micro-batch's mean divided by the number of micro-batches) for contrast. An additivity
check tells whether the loss can be accumulated exactly at all, and names what breaks it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fullbatch._split import count_rows
from fullbatch._verify._additivity import check_additivity
from fullbatch._verify._arms import (
    ArmResult,
    LossFn,
    compare,
    full_batch_arm,
    fullbatch_arm,
    grad_norm,
    naive_arm,
    relative,
)
from fullbatch._verify._precision import TOLERANCES, dtype_name, working_copy
from fullbatch._verify._report import AdditivityCheck, GradientComparison, VerifyReport
from fullbatch._verify._state import ModelSnapshot, disable_dropout

__all__ = ["verify"]


def _comparison(recipe: str, arm: ArmResult, ref: ArmResult, ref_norm: float) -> GradientComparison:
    worst, name, global_error = compare(ref.grads, arm.grads)
    norm = arm.reported_grad_norm if arm.reported_grad_norm is not None else grad_norm(arm.grads)
    if arm.skipped_reason is not None:
        worst = global_error = math.nan
    return GradientComparison(
        recipe=recipe,
        max_rel_error=worst,
        worst_tensor=name,
        global_rel_error=global_error,
        loss=arm.loss,
        loss_rel_error=relative(arm.loss, ref.loss),
        grad_norm=norm,
        grad_norm_rel_error=relative(norm, ref_norm),
    )


def _check_arguments(model: Any, loss_fn: Any, micro_batch_size: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
    if not callable(loss_fn):
        raise TypeError(
            f"loss_fn must be callable as loss_fn(model, micro) -> (loss_sum, count), got "
            f"{type(loss_fn).__name__}."
        )
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int):
        raise ValueError(f"micro_batch_size must be a positive int, got {micro_batch_size!r}.")
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be a positive int, got {micro_batch_size}.")


def verify(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    *,
    micro_batch_size: int,
    dtype: torch.dtype | None = None,
    rtol: float | None = None,
) -> VerifyReport:
    """Check that fullbatch's accumulated gradient equals the full-batch gradient.

    One step from the model's current parameters is computed three ways on ``batch``: the
    whole batch at once (the reference), one window of :class:`fullbatch.Accumulator` with
    ``micro_batch_size`` rows per micro-batch, and the naive ``loss / K`` recipe. Dropout is
    switched off completely during the comparison: ``p = 0`` on every dropout module (some
    modules apply ``dropout.p`` at their own training flag, e.g. GPT-2's attention), eval mode,
    and float dropout attributes set to 0; the report's notes list each change, and all of it is
    restored afterwards. Leftover randomness is detected by evaluating the full batch twice.

    The model is left exactly as it was: parameters are never written; gradients,
    ``requires_grad``, training flags, buffers (BatchNorm statistics) and the torch RNG state
    (CPU and CUDA) are restored.

    Args:
        model: the model, with the parameters to test from.
        batch: one batch, a tensor or a dict of tensors with rows first (as a loader yields).
        loss_fn: ``loss_fn(model, micro) -> (loss_sum, count)``: the loss *summed* over the
            micro-batch's items and how many items that is (see ``fb.cross_entropy_sum``).
        micro_batch_size: rows per micro-batch; pick one that makes several micro-batches.
        dtype: compare on a copy in this dtype (e.g. ``torch.float64`` for a tight check).
            By default the model's dtype; bfloat16/float16 models are compared on a float32
            copy when it fits in memory.
        rtol: relative tolerance; by default 1e-10 for float64 and 1e-5 for float32. A float64
            model that computes partly in float32 (its own full-batch gradient moves by more
            than 1e-10 when the loss is normalized after backward instead of before) is held
            to 1e-5, and the report says so.

    Returns:
        A :class:`VerifyReport`: ``.passed``, ``.diagnosis`` and a readable ``str()``.

    Raises:
        TypeError, ValueError: bad arguments, or ``loss_fn`` not returning ``(loss_sum, count)``.

    >>> import torch, fullbatch as fb
    >>> model = torch.nn.Linear(4, 3).double()
    >>> batch = {"x": torch.randn(6, 4, dtype=torch.float64), "y": torch.tensor([0, 1, 2, 0, 1, 2])}
    >>> loss_fn = lambda m, b: fb.cross_entropy_sum(m(b["x"]), b["y"])
    >>> fb.verify(model, batch, loss_fn, micro_batch_size=4).passed
    True
    """
    _check_arguments(model, loss_fn, micro_batch_size)
    rows = count_rows(batch)
    notes: list[str] = []
    snapshot = ModelSnapshot.capture(model)
    dropout = None
    try:
        with torch.enable_grad():
            work, work_batch, compute_dtype = working_copy(model, batch, dtype, notes)
            dropout = disable_dropout(work)
            notes += [f"disabled for the comparison: {line}" for line in dropout.describe()]
            runs = _run_arms(work, work_batch, loss_fn, micro_batch_size, notes)
            tol = rtol if rtol is not None else TOLERANCES[compute_dtype]
            if rtol is None and compute_dtype == torch.float64 and _is_rounding(runs, tol):
                tol = TOLERANCES[torch.float32]
                notes.append(
                    f"the model computes partly in float32 or lower (normalizing after backward "
                    f"moves its own full-batch gradient by {runs.band:.1e} > 1e-10, e.g. an "
                    f"RMSNorm that upcasts to float32): float32's tolerance {tol:g} applies"
                )
            additivity = check_additivity(work, work_batch, loss_fn, tol)
        return _report(
            runs, additivity, tol, dtype_name(compute_dtype), rows, micro_batch_size, notes
        )
    finally:
        if dropout is not None:
            dropout.restore()
        snapshot.restore()


@dataclass
class _Runs:
    """The arms' results, before any verdict."""

    ref: ArmResult
    fullbatch: ArmResult
    naive: ArmResult
    nondeterminism: float  # grad error between two identical full-batch evaluations
    band: float  # grad error of the full batch normalized after instead of before backward


def _is_rounding(runs: _Runs, tol: float) -> bool:
    return runs.nondeterminism <= tol < runs.band


def _run_arms(
    work: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    micro_batch_size: int,
    notes: list[str],
) -> _Runs:
    """Run every arm on ``work``, with its buffers reset to their start values in between."""
    params = [(n, p) for n, p in work.named_parameters() if p.requires_grad]
    start = ModelSnapshot.capture(work)  # only its buffers are used
    try:
        ref = full_batch_arm(work, params, batch, loss_fn)
        if ref.count == 0:
            raise ValueError(
                "the batch counts 0 items (every label ignored?): nothing to compare; pass a "
                "batch for which loss_fn returns a positive count."
            )
        start.restore_buffers()
        again = full_batch_arm(work, params, batch, loss_fn)
        start.restore_buffers()
        after = full_batch_arm(work, params, batch, loss_fn, normalize_after=True)
        start.restore_buffers()
        fullbatch = fullbatch_arm(work, params, batch, loss_fn, micro_batch_size)
        start.restore_buffers()
        naive = naive_arm(work, params, batch, loss_fn, micro_batch_size)
    finally:
        start.restore_buffers()
    notes += fullbatch.warnings
    return _Runs(
        ref=ref,
        fullbatch=fullbatch,
        naive=naive,
        nondeterminism=compare(ref.grads, again.grads)[0],
        band=compare(ref.grads, after.grads)[0],
    )


def _diagnose(
    runs: _Runs, fb_error: GradientComparison, additivity: AdditivityCheck | None, tol: float
) -> list[str]:
    diagnosis: list[str] = []
    deterministic = runs.nondeterminism <= tol
    if runs.fullbatch.skipped_reason is not None:
        diagnosis.append(f"fullbatch skipped the step ({runs.fullbatch.skipped_reason})")
    elif not fb_error.worst_error <= tol:
        where = f" (worst tensor {fb_error.worst_tensor})" if fb_error.worst_tensor else ""
        if not (deterministic and (additivity is None or additivity.holds)):
            why = "expected, see below"
        elif runs.band * 10 >= fb_error.worst_error:
            why = (
                f"the model's own rounding band is {runs.band:.1e} (normalizing after backward "
                "moves the full-batch gradient that much), so this is most likely rounding "
                "inside the model; pass a larger rtol or compare in float64"
            )
        else:
            why = (
                "loss_fn is additive and deterministic, so this is a fullbatch bug; please "
                "report it with this output"
            )
        diagnosis.append(
            f"fullbatch differs from the full batch by {fb_error.worst_error:.2e} > {tol:g}"
            f"{where}: {why}"
        )
    if not deterministic:
        diagnosis.append(
            f"randomness left: two identical full-batch evaluations differ by "
            f"{runs.nondeterminism:.2e} > {tol:g}, so no comparison is reliable; something "
            "random is still active (functional dropout with a fixed p, stochastic depth, "
            "random augmentation in forward or loss_fn); make it deterministic for the check, "
            "e.g. model.eval() when the model has no BatchNorm"
        )
    if additivity is not None and not additivity.holds and deterministic:
        diagnosis += list(additivity.causes)
    return diagnosis


def _report(
    runs: _Runs,
    additivity: AdditivityCheck | None,
    tol: float,
    dtype: str,
    rows: int,
    micro_batch_size: int,
    notes: list[str],
) -> VerifyReport:
    ref_norm = grad_norm(runs.ref.grads)
    fb_error = _comparison("fullbatch", runs.fullbatch, runs.ref, ref_norm)
    naive_error = _comparison("naive (loss / K)", runs.naive, runs.ref, ref_norm)
    micro_batches = math.ceil(rows / micro_batch_size)
    diagnosis = _diagnose(runs, fb_error, additivity, tol)
    if additivity is None:
        notes.append("one row: the additivity check needs at least 2 rows")
    elif not additivity.holds and runs.nondeterminism > tol:
        notes.append("additivity is not diagnosed while randomness is left")
    if micro_batches == 1:
        notes.append(
            f"micro_batch_size {micro_batch_size} >= {rows} rows: a single micro-batch, so the "
            "gradient comparison is trivial; use a smaller micro_batch_size"
        )
    elif naive_error.worst_error <= tol:
        notes.append(
            "the naive recipe is exact here too: every micro-batch counts the same number of "
            "items (vary padding or -100 labels to see it fail)"
        )
    return VerifyReport(
        passed=not diagnosis,
        diagnosis=diagnosis,
        fullbatch=fb_error,
        naive=naive_error,
        additivity=additivity,
        nondeterminism=runs.nondeterminism,
        rounding_band=runs.band,
        tolerance=tol,
        dtype=dtype,
        rows=rows,
        micro_batch_size=micro_batch_size,
        micro_batches=micro_batches,
        count=runs.ref.count,
        loss=runs.ref.loss,
        grad_norm=ref_norm,
        notes=notes,
    )

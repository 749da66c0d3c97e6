"""``fb.verify``: prove, on the user's own model and batch, that fullbatch equals the full batch.

Three gradients from the same parameters: the plain full-batch reference (``loss_sum / count``,
one backward), one window of the real :class:`fullbatch.Accumulator`, and the naive recipe
(each micro-batch's mean divided by the number of micro-batches) for contrast. An additivity
check tells whether the loss can be accumulated exactly at all, and names what breaks it.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn

from fullbatch._verify_additivity import check_additivity
from fullbatch._verify_arms import (
    ArmResult,
    LossFn,
    compare,
    count_rows,
    full_batch_arm,
    fullbatch_arm,
    grad_norm,
    naive_arm,
    relative,
)
from fullbatch._verify_report import GradientComparison, VerifyReport
from fullbatch._verify_state import ModelSnapshot, disable_dropout

__all__ = ["TOLERANCES", "verify"]

#: Relative tolerance by the dtype the comparison runs in. Half-precision values are a band
#: for when no float32 copy fits, not a proof.
TOLERANCES: dict[torch.dtype, float] = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.bfloat16: 2e-2,
    torch.float16: 2e-3,
}
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def _param_dtype(model: nn.Module) -> torch.dtype:
    """The least precise floating dtype among trainable parameters."""
    dtypes = {p.dtype for p in model.parameters() if p.requires_grad and p.is_floating_point()}
    if not dtypes:
        raise ValueError(
            "the model has no trainable floating-point parameters: nothing to verify; set "
            "requires_grad=True on the parameters you train."
        )
    return max(dtypes, key=lambda d: torch.finfo(d).eps)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _cast_floats(batch: Any, dtype: torch.dtype) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(dtype) if batch.is_floating_point() else batch
    if isinstance(batch, dict):
        return {k: _cast_floats(v, dtype) for k, v in batch.items()}
    return batch


def _working_copy(
    model: nn.Module, batch: Any, dtype: torch.dtype | None, notes: list[str]
) -> tuple[nn.Module, Any, torch.dtype]:
    """The model and batch to compare on: the original, or a copy in another dtype."""
    native = _param_dtype(model)
    target = dtype if dtype is not None else native
    if dtype is None and native in _LOW_PRECISION:
        target = torch.float32
    if target == native:
        return model, batch, native
    try:
        work = copy.deepcopy(model).to(target)
    except torch.OutOfMemoryError:
        if dtype is not None:
            raise
        notes.append(
            f"compared in {_name(native)} because a float32 copy did not fit in memory: the "
            f"tolerance {TOLERANCES[native]:g} is a rounding band, not a proof"
        )
        return model, batch, native
    notes.append(f"compared on a {_name(target)} copy of the {_name(native)} model")
    return work, _cast_floats(batch, target), target


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
    disabled during the comparison; leftover randomness is detected by evaluating the full batch
    twice. The model is left exactly as it was: parameters are never written; gradients,
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
        rtol: relative tolerance; by default 1e-10 for float64 and 1e-5 for float32.

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
    try:
        with torch.enable_grad():
            return _run(model, batch, loss_fn, micro_batch_size, dtype, rtol, rows, notes, snapshot)
    finally:
        snapshot.restore()


def _run(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    micro_batch_size: int,
    dtype: torch.dtype | None,
    rtol: float | None,
    rows: int,
    notes: list[str],
    snapshot: ModelSnapshot,
) -> VerifyReport:
    work, batch, compute_dtype = _working_copy(model, batch, dtype, notes)
    tol = rtol if rtol is not None else TOLERANCES[compute_dtype]
    dropout = disable_dropout(work)
    notes += [f"disabled for the comparison: {line}" for line in dropout.describe()]
    params = [(n, p) for n, p in work.named_parameters() if p.requires_grad]
    snap = snapshot if work is model else ModelSnapshot.capture(work)
    try:
        ref = full_batch_arm(work, params, batch, loss_fn)
        if ref.count == 0:
            raise ValueError(
                "the batch counts 0 items (every label ignored?): nothing to compare; pass a "
                "batch for which loss_fn returns a positive count."
            )
        snap.restore_buffers()
        again = full_batch_arm(work, params, batch, loss_fn)
        snap.restore_buffers()
        fullbatch = fullbatch_arm(work, params, batch, loss_fn, micro_batch_size)
        snap.restore_buffers()
        naive = naive_arm(work, params, batch, loss_fn, micro_batch_size)
        snap.restore_buffers()
        additivity = check_additivity(work, batch, loss_fn, tol)
    finally:
        dropout.restore()
    ref_norm = grad_norm(ref.grads)
    nondeterminism = compare(ref.grads, again.grads)[0]
    fb_cmp = _comparison("fullbatch", fullbatch, ref, ref_norm)
    naive_cmp = _comparison("naive (loss / K)", naive, ref, ref_norm)
    notes += fullbatch.warnings
    micro_batches = math.ceil(rows / micro_batch_size)

    diagnosis: list[str] = []
    if fullbatch.skipped_reason is not None:
        diagnosis.append(f"fullbatch skipped the step ({fullbatch.skipped_reason})")
    elif not fb_cmp.worst_error <= tol:
        where = f" (worst tensor {fb_cmp.worst_tensor})" if fb_cmp.worst_tensor else ""
        clean = (additivity is None or additivity.holds) and nondeterminism <= tol
        diagnosis.append(
            f"fullbatch differs from the full batch by {fb_cmp.worst_error:.2e} > {tol:g}{where}"
            + (
                ": loss_fn is additive and deterministic, so this is a fullbatch bug; please "
                "report it with this output"
                if clean
                else ": expected, see below"
            )
        )
    if not nondeterminism <= tol:
        diagnosis.append(
            f"randomness left: two identical full-batch evaluations differ by "
            f"{nondeterminism:.2e} > {tol:g}, so no comparison is reliable; something random "
            "is still active (functional dropout with a fixed p, stochastic depth, random "
            "augmentation in forward or loss_fn); make it deterministic for the check, e.g. "
            "model.eval() when the model has no BatchNorm"
        )
    if additivity is not None and not additivity.holds:
        if nondeterminism <= tol:
            diagnosis += list(additivity.causes)
        else:
            notes.append("additivity is not diagnosed while randomness is left")
    if additivity is None:
        notes.append("one row: the additivity check needs at least 2 rows")
    if micro_batches == 1:
        notes.append(
            f"micro_batch_size {micro_batch_size} >= {rows} rows: a single micro-batch, so the "
            "gradient comparison is trivial; use a smaller micro_batch_size"
        )
    elif naive_cmp.worst_error <= tol:
        notes.append(
            "the naive recipe is exact here too: every micro-batch counts the same number of "
            "items (vary padding or -100 labels to see it fail)"
        )
    return VerifyReport(
        passed=not diagnosis,
        diagnosis=diagnosis,
        fullbatch=fb_cmp,
        naive=naive_cmp,
        additivity=additivity,
        nondeterminism=nondeterminism,
        tolerance=tol,
        dtype=_name(compute_dtype),
        rows=rows,
        micro_batch_size=micro_batch_size,
        micro_batches=micro_batches,
        count=ref.count,
        loss=ref.loss,
        grad_norm=ref_norm,
        notes=notes,
    )

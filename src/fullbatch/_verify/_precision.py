"""Which dtype ``verify`` compares in, and the tolerance that goes with it.

Tolerances are relative (see :mod:`fullbatch._verify._report` for the error measures): float64
1e-10, float32 1e-5. A bfloat16/float16 model is compared on a float32 copy when that fits in
memory; otherwise (or with ``dtype=torch.bfloat16``) in its own dtype.

A model that computes in lower precision than its parameters (autocast, a float64 model with
float32 internals) cannot meet its dtype's tolerance: the full batch itself moves by more than
that when its loss is normalized after backward instead of before, or its rows are permuted.
That movement is the model's own *rounding band*; :func:`widen_tolerance` then holds fullbatch
to ``BAND_FACTOR`` times the band (:mod:`fullbatch._proof._tolerance`), and says so.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from fullbatch._proof._tolerance import BAND_CAP, BAND_FACTOR
from fullbatch._verify._arms import LossFn

__all__ = [
    "TOLERANCES",
    "check_autocast",
    "dtype_name",
    "under_autocast",
    "widen_tolerance",
    "working_copy",
]

#: Relative tolerance by the dtype the comparison runs in.
TOLERANCES: dict[torch.dtype, float] = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.bfloat16: 2e-2,
    torch.float16: 2e-3,
}
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``.

    >>> dtype_name(torch.bfloat16)
    'bfloat16'
    """
    return str(dtype).removeprefix("torch.")


def check_autocast(autocast: Any) -> torch.dtype | None:
    """``autocast`` if it is ``None``, ``torch.bfloat16`` or ``torch.float16``, else ValueError.

    >>> check_autocast(torch.bfloat16)
    torch.bfloat16
    """
    if autocast is None or autocast in _LOW_PRECISION:
        return autocast
    raise ValueError(
        f"autocast must be torch.bfloat16 or torch.float16 (the dtype torch.autocast computes "
        f"in), or None, got {autocast!r}; e.g. fb.verify(..., autocast=torch.bfloat16)."
    )


def under_autocast(loss_fn: LossFn, device_type: str, dtype: torch.dtype) -> LossFn:
    """``loss_fn`` run under ``torch.autocast(device_type, dtype)``; backward stays outside.

    >>> model = torch.nn.Linear(2, 2)
    >>> fn = under_autocast(lambda m, b: (m(b).sum(), 1), "cpu", torch.bfloat16)
    >>> fn(model, torch.ones(1, 2))[0].dtype
    torch.bfloat16
    """

    def autocast_loss_fn(model: nn.Module, micro: Any) -> tuple[torch.Tensor, Any]:
        with torch.autocast(device_type, dtype=dtype):
            return loss_fn(model, micro)

    return autocast_loss_fn


def widen_tolerance(
    tol: float, band: float, nondeterminism: float, compute: str, notes: list[str]
) -> float:
    """The tolerance for a model whose own rounding ``band`` exceeds its dtype's ``tol``.

    Widened only when the band is rounding: below ``BAND_CAP``, and the model deterministic
    (two identical evaluations differ by at most a quarter of the band), so that leftover
    randomness is never mistaken for rounding. A float64 model within float32's band gets
    float32's tolerance; any other gets ``BAND_FACTOR * band``. The reason goes to ``notes``.

    >>> notes = []
    >>> widen_tolerance(1e-5, 8e-3, 0.0, "float32", notes)
    0.032
    >>> notes[0].split(":")[0]
    'the model computes in lower precision than float32 (autocast or low-precision internals)'
    """
    if not (tol < band * BAND_FACTOR and band <= BAND_CAP):
        return tol
    if nondeterminism > max(tol, band / BAND_FACTOR):
        return tol
    if compute == "float64" and tol < band <= TOLERANCES[torch.float32]:
        notes.append(
            f"the model computes partly in float32 or lower (normalizing after backward moves "
            f"its own full-batch gradient by {band:.1e} > 1e-10, e.g. an RMSNorm that upcasts "
            f"to float32): float32's tolerance 1e-05 applies"
        )
        return TOLERANCES[torch.float32]
    wide = BAND_FACTOR * band
    what = (
        compute
        if "autocast" in compute or compute in ("bfloat16", "float16")
        else f"lower precision than {compute} (autocast or low-precision internals)"
    )
    notes.append(
        f"the model computes in {what}: its own full-batch gradient moves by up to {band:.1e} "
        f"(rounding band: loss normalized after backward, or rows permuted), so fullbatch is "
        f"held to {BAND_FACTOR:g}x that band, {wide:.1e}: equal up to rounding in this "
        f"precision, not a proof beyond it (compare in float32 or float64 for a tight check)"
    )
    return wide


def _param_dtype(model: nn.Module) -> torch.dtype:
    """The least precise floating dtype among trainable parameters."""
    dtypes = {p.dtype for p in model.parameters() if p.requires_grad and p.is_floating_point()}
    if not dtypes:
        raise ValueError(
            "the model has no trainable floating-point parameters: nothing to verify; set "
            "requires_grad=True on the parameters you train."
        )
    return max(dtypes, key=lambda d: torch.finfo(d).eps)


def _cast_floats(batch: Any, dtype: torch.dtype) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(dtype) if batch.is_floating_point() else batch
    if isinstance(batch, dict):
        return {k: _cast_floats(v, dtype) for k, v in batch.items()}
    return batch


def working_copy(
    model: nn.Module, batch: Any, dtype: torch.dtype | None, notes: list[str]
) -> tuple[nn.Module, Any, torch.dtype]:
    """The model and batch to compare on (the originals, or a copy cast to another dtype).

    With ``dtype=None`` the model's own dtype is used, except that bfloat16/float16 models are
    copied to float32 when the copy fits. What was done is appended to ``notes``.

    >>> notes = []
    >>> work, _, dtype = working_copy(torch.nn.Linear(2, 2).half(), None, None, notes)
    >>> work.weight.dtype, notes
    (torch.float32, ['compared on a float32 copy of the float16 model'])
    """
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
            f"compared in {dtype_name(native)} because a float32 copy did not fit in memory: "
            f"the tolerance {TOLERANCES[native]:g} is a rounding band, not a proof"
        )
        return model, batch, native
    notes.append(f"compared on a {dtype_name(target)} copy of the {dtype_name(native)} model")
    return work, _cast_floats(batch, target), target

"""Which dtype ``verify`` compares in, and the tolerance that goes with it.

Tolerances are relative (see :mod:`fullbatch._verify._report` for the error measures): float64
1e-10, float32 1e-5. A bfloat16/float16 model is compared on a float32 copy when that fits in
memory; otherwise in its own dtype with a looser band that is a rounding allowance, not a
proof.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

__all__ = ["TOLERANCES", "dtype_name", "working_copy"]

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

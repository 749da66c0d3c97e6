"""``accumulate_dtype``: low-precision parameters accumulate their gradient in float32.

A bf16 parameter's ``.grad`` is bf16, and autograd accumulates every backward into it in
bf16: each micro-batch adds a rounding of relative size ~2^-9 to the running sum, so the error
of a window's gradient grows with its number of micro-batches (and small late contributions
are lost next to a large sum). With ``accumulate_dtype=torch.float32`` fullbatch keeps one
float32 buffer per low-precision parameter for the window:

- after every ``window.backward`` the bf16 gradient that backward produced is added into the
  buffer and ``p.grad`` is set back to ``None`` (the next backward starts a fresh one);
- at ``step()`` the norm, the skip check, normalization ``W/(c·N)`` and clipping are computed
  on the float32 buffers; then each is cast **once** to the parameter's dtype and handed to
  the optimizer as ``p.grad`` (PyTorch requires ``p.grad`` to have the parameter's dtype, so
  an optimizer cannot receive the float32 buffer itself; optimizers keeping float32 master
  weights upcast it again, exactly). The error is then one rounding, whatever the window.

Parameters as wide as ``accumulate_dtype`` or wider (float32, float64) are left alone. Memory:
``accumulate_dtype``'s itemsize per buffered parameter element (4 bytes for float32), held
from a parameter's first backward in the window to the step.

Distributed: under DDP it needs ``ddp_sync="step"``, where fullbatch all-reduces the float32
buffers once at the step (with ``"last"`` DDP would average the bf16 ``.grad`` of the final
backward only). FSDP2 is refused: it has its own float32 accumulation
(``MixedPrecisionPolicy(reduce_dtype=torch.float32)``). A GradScaler is refused too: fp16
parameters cannot be unscaled by it (torch raises), and bf16 needs no loss scaling.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["GradBuffers", "make_grad_buffers"]


def _narrower(param: torch.Tensor, dtype: torch.dtype) -> bool:
    return param.is_floating_point() and torch.finfo(param.dtype).bits < torch.finfo(dtype).bits


def make_grad_buffers(
    accumulate_dtype: torch.dtype | None, params: list[nn.Parameter], sync: Any, scaler: Any
) -> GradBuffers | None:
    """The buffers for ``accumulate_dtype`` (a floating dtype, checked by ``StepPlan``);
    ``None`` when no parameter is narrower than it.

    Raises:
        ValueError: a sharded wrapper (FSDP2); a wrapper that synchronizes inside the backward
            (DDP without ``ddp_sync="step"``); a GradScaler, when some parameter would be
            buffered.
    """
    if accumulate_dtype is None:
        return None
    buffered = [p for p in params if _narrower(p, accumulate_dtype)]
    if not buffered:
        return None
    kinds = sorted({str(p.dtype) for p in buffered})
    what = f"accumulate_dtype={accumulate_dtype} with {len(buffered)} {'/'.join(kinds)} parameters"
    if sync.sharded:
        raise ValueError(
            f"{what} under FSDP2 is not supported: keep float32 sharded parameters and let "
            "FSDP2 accumulate in float32, fully_shard(model, mp_policy=MixedPrecisionPolicy("
            "param_dtype=torch.bfloat16, reduce_dtype=torch.float32)), and drop "
            "accumulate_dtype."
        )
    if sync.syncs_in_backward:
        raise ValueError(
            f"{what} under DDP needs ddp_sync='step': with 'last', DDP averages the "
            "low-precision .grad of the final backward only, not the float32 buffers. Build "
            "the Accumulator with ddp_sync='step' (fullbatch then all-reduces the float32 "
            "buffers once per window)."
        )
    if scaler is not None:
        raise ValueError(
            f"{what} and a GradScaler: a GradScaler cannot unscale fp16 parameters' gradients "
            "(torch refuses), and bf16 has float32's range, so it needs no loss scaling. Drop "
            "scaler= (or train float32 parameters under fp16 autocast with the scaler, "
            "without accumulate_dtype)."
        )
    plain = [p for p in params if not _narrower(p, accumulate_dtype)]
    return GradBuffers(buffered, plain, accumulate_dtype)


class GradBuffers:
    """One ``accumulate_dtype`` gradient buffer per low-precision parameter, for one window.

    >>> w = nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    >>> buffers = GradBuffers([w], [])
    >>> for _ in range(512):  # 512 backward calls, each adding 2^-8: 2.0 in all
    ...     (w / 256).sum().backward()
    ...     buffers.after_backward()
    >>> buffers.grads()[0].dtype, w.grad is None
    (torch.float32, True)
    >>> buffers.write_back(); w.grad.dtype, float(w.grad[0])
    (torch.bfloat16, 2.0)
    >>> w.grad = None
    >>> for _ in range(512):  # the same in bf16: stuck at 1.0, where 2^-8 is half a step
    ...     (w / 256).sum().backward()
    >>> float(w.grad[0])
    1.0
    """

    def __init__(
        self,
        buffered: list[nn.Parameter],
        plain: list[nn.Parameter],
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.buffered = buffered
        self.plain = plain  # the parameters whose .grad fullbatch uses as it is
        self._dtype = dtype
        self._buffers: list[torch.Tensor | None] = [None] * len(buffered)

    @property
    def element_size(self) -> int:
        """Bytes per buffered parameter element (4 for float32)."""
        return torch.empty((), dtype=self._dtype).element_size()

    def after_backward(self) -> None:
        """Move the gradients of the backward that just ran into the buffers."""
        adds: list[torch.Tensor] = []
        into: list[torch.Tensor] = []
        for i, p in enumerate(self.buffered):
            grad = p.grad
            if grad is None:
                continue
            buffer = self._buffers[i]
            if buffer is None:
                self._buffers[i] = grad.to(self._dtype)
            else:
                into.append(buffer)
                adds.append(grad)
            p.grad = None
        if into:
            torch._foreach_add_(into, adds)

    def reduce(self, sync: Any) -> None:
        """``ddp_sync="step"``: sum the buffers (and the plain gradients) over ranks."""
        for i, p in enumerate(self.buffered):
            if self._buffers[i] is None:  # unused on this rank, maybe used on another
                self._buffers[i] = torch.zeros_like(p, dtype=self._dtype)
        sync.reduce_tensors([b for b in self._buffers if b is not None])
        sync.reduce_gradients(self.plain)

    def grads(self) -> list[torch.Tensor]:
        """The window's gradients for the norm and scaling: buffers, then plain ``.grad``."""
        held = [b for b in self._buffers if b is not None]
        return held + [p.grad for p in self.plain if p.grad is not None]

    def write_back(self) -> None:
        """Hand the optimizer ``p.grad``: each buffer cast once to its parameter's dtype."""
        for p, buffer in zip(self.buffered, self._buffers, strict=True):
            if buffer is not None:
                p.grad = buffer.to(p.dtype)

    def clear(self) -> None:
        self._buffers = [None] * len(self.buffered)

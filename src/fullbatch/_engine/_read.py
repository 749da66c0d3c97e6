"""The window's numbers at the step: computed on the device, reduced over ranks, read once.

A hand-written loop on a GPU never waits for the device between two windows; fullbatch waits
exactly once, here: every number :func:`fullbatch._base._verdict.decide` needs (loss sum,
count, the bad-count and form flags, the squared gradient norm, the GradScaler's scale) and
the learning rate are stacked into one small device tensor, summed over the counting group by
one all-reduce where they differ per rank, and read back with a single ``tolist()``.

>>> import torch
>>> from fullbatch._engine._read import WindowNumbers
>>> WindowNumbers.from_list([3.0, 2.0, 0, 0, 0, 0, 2, 0.25, 4.0, 0.1]).squared_norm(False)
0.015625
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from fullbatch._base._normalize import accumulation_dtype, squared_norm
from fullbatch._engine._core import Engine
from fullbatch._engine._state import WindowState

__all__ = ["WindowNumbers", "pair_discard", "read_numbers"]

# Slots summed over the counting group (the one all-reduce at the step), and the slots that
# are already the same on every rank (read with them, not reduced).
_SUMMED = 7
_LOSS, _COUNT, _BAD_COUNT, _SHARD_SQ, _DISCARDED, _SHARE_CALLS, _COUNT_CALLS = range(_SUMMED)
_LOCAL_SQ, _SCALE, _LR = range(3)


@dataclass(frozen=True, slots=True)
class WindowNumbers:
    """What the step read: sums over ranks, and this rank's (replicated) norm, scale and LR."""

    loss: float
    count: float
    bad_counts: float  # device-tensor counts that were negative or non-finite
    shard_sq: float  # sharded gradients: the squared norm summed over ranks (scaled)
    discarded: float  # ranks that discarded the window
    share_calls: float
    count_calls: float
    local_sq: float  # replicated gradients: this rank's squared norm (scaled)
    scale: float  # the GradScaler's scale (1.0 without one)
    lr: float  # a tensor learning rate's value (NaN: the LR is a Python number)

    @classmethod
    def from_list(cls, values: list[float]) -> WindowNumbers:
        return cls(*values)

    def squared_norm(self, sharded: bool) -> float:
        """The squared norm of the unscaled gradient (the scale is a power of two: exact)."""
        sq = self.shard_sq if sharded else self.local_sq
        return sq / self.scale**2


def _scale_tensor(scaler: Any) -> torch.Tensor | None:
    """The GradScaler's scale as the device tensor it keeps (no host read), if it has one."""
    get = getattr(scaler, "_get_scale_async", None)
    scale = get() if callable(get) else None
    return scale if isinstance(scale, torch.Tensor) else None


def read_numbers(
    engine: Engine, state: WindowState, grads: list[torch.Tensor], *, norm: bool = True
) -> WindowNumbers:
    """Stack, reduce and read the window's numbers: one collective, one host synchronization.

    ``norm=False`` leaves the replicated norm out (0), for a caller that combines gradients
    over context-parallel ranks after this read and computes the norm then.
    """
    sync = engine.sync
    device = engine.stat_device
    dtype = accumulation_dtype(device)
    zero = torch.zeros((), dtype=dtype, device=device)
    summed = [zero] * _SUMMED
    loss, counts, bad = state.sums(device, dtype)
    if sync.counts_here:  # model ranks beyond a mesh's first hold the same items
        summed[_LOSS] = loss
        summed[_COUNT] = counts + state.count_py
    summed[_BAD_COUNT] = bad
    # The replicated slots hold device values only where there are some (Python numbers
    # need no read): the norm, the GradScaler's scale, a tensor learning rate.
    local: dict[int, torch.Tensor] = {}
    # The norm of the gradients as accumulated (times the GradScaler's scale, divided out
    # after the read: unscale_ comes after the verdict, so a refused window leaves the
    # scaler as it was).
    if sync.sharded:
        # Ranks holding the same piece (HSDP replicas, a tensor-parallel Replicate dim) each
        # add their share.
        summed[_SHARD_SQ] = sync.norm_share(grads, device)
    elif norm and grads:
        local[_LOCAL_SQ] = squared_norm(grads, device)
    # The form is agreed over ranks: a rank without micro-batches made no call at all.
    form_slot = _SHARE_CALLS if state.form == "share" else _COUNT_CALLS
    summed[form_slot] = zero + state.backwards
    scaler = engine.step_plan.scaler
    scale = _scale_tensor(scaler) if scaler is not None else None
    if scale is not None:
        local[_SCALE] = scale.to(device, dtype)
    lr = _lr_tensor(engine)
    if lr is not None:
        local[_LR] = lr.detach().to(device, dtype)
    reduced = torch.stack(summed)
    if sync.step_group is not None:  # over data x model ranks on a composed mesh
        reduced = sync.all_reduce_sum(reduced, step=True)
    if local:
        reduced = torch.cat([reduced, torch.stack(list(local.values()))])
    values = reduced.tolist()  # the one read
    replicated = [0.0, 1.0, math.nan]
    for slot, value in zip(local, values[_SUMMED:], strict=True):
        replicated[slot] = value
    return WindowNumbers.from_list(values[:_SUMMED] + replicated)


def pair_discard(engine: Engine) -> None:
    """``window.discard()`` under DDP/FSDP2: the same all-reduce as the others' step, no read."""
    device = engine.stat_device
    summed = torch.zeros(_SUMMED, dtype=accumulation_dtype(device), device=device)
    summed[_DISCARDED] = 1
    engine.sync.all_reduce_sum(summed, step=True)


def _lr_tensor(engine: Engine) -> torch.Tensor | None:
    groups = engine.optimizer.param_groups
    lr = groups[0].get("lr") if groups else None
    return lr if isinstance(lr, torch.Tensor) else None

"""The reference: the declared objective's gradient over the window's micro-batches, recomputed
once per window and summed over the ranks.

Each recorded call is replayed (:mod:`fullbatch._probe._replay`) and its gradient ``∇S_k`` added
into one gradient-sized buffer; the sum over micro-batches and ranks ``Σ_rk ∇S_rk`` is divided
by the window's count ``N`` by the caller. Each micro-batch also leaves the sampled coordinates
of its own ``∇S_k`` for the weight fit. Buffers (BatchNorm statistics) and the RNG streams are
put back afterwards; ``.grad`` is never touched. Where :mod:`fullbatch._probe._early` already
took every call of the window at its forward (the same sums, samples and band, on the engine's
own graphs), :func:`recompute` hands that over and replays nothing.

**The band.** The first micro-batch with items (the one with most rows) is differentiated a
second time as another engine would compute it: its loss scaled by ``1 / d`` before backward
(``d = 3 · n · K``, as a per-micro-batch mean over ``K`` micro-batches would be; no power of
two) and its rows reversed when that changes no dropout mask. ``δ = d · ∇(S/d) − ∇S`` is a
measured sample of this model's rounding: its norm makes the band, its sampled coordinates
(relative to that micro-batch's gradient) the per-coordinate noise the fit's precision comes
from.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fullbatch._base._rng import RngState
from fullbatch._base._sync._probe import sum_tensors
from fullbatch._probe._call_loss import ObjectiveFn
from fullbatch._probe._capture import Call
from fullbatch._probe._replay import Grads, replay, reversed_call, rows_of
from fullbatch._probe._sample import Sampler, whole_shape
from fullbatch._proof._norms import squared

__all__ = ["LocalReference", "add_into", "recompute", "summed_over_ranks"]


@dataclass
class LocalReference:
    """One rank's share of a window.

    Attributes:
        ref: ``Σ_k ∇S_k`` for each parameter (not divided; None: no gradient).
        samples: each call's sampled ``∇S_k``, in the order the calls ran.
        counts: each call's item count under the objective.
        band: ``‖δ‖`` over all coordinates (absolute, in the units of ``∇S``); band_count: the
            item count of the micro-batch it was measured on.
        delta: the sampled coordinates of ``δ``, per unit of the band micro-batch's sampled
            gradient norm (a relative rounding pattern, scaled to each micro-batch by the fit).
        band_rows_reversed: whether the band run reversed the rows.
    """

    ref: Grads
    samples: list[torch.Tensor] = field(default_factory=list)
    counts: list[float] = field(default_factory=list)
    band: float = 0.0
    band_count: float = 0.0
    delta: torch.Tensor | None = None
    band_rows_reversed: bool = False

    def note_band(
        self, grads: Grads, again: Grads, sample: torch.Tensor, again_sample: torch.Tensor,
        divisor: float, count: float,
    ) -> None:  # fmt: skip
        """The band from one micro-batch: ``grads`` its ``∇S`` (sampled: ``sample``), ``again``
        the same differentiated with the loss divided by ``divisor`` (sampled:
        ``again_sample``), ``count`` its items."""
        self.band = math.sqrt(squared(again, grads, scale=divisor))
        delta = again_sample * divisor - sample  # δ, sampled (float64)
        size = float(sample.norm())
        self.delta = delta / size if size > 0 else delta * 0
        self.band_count = count


def _band(
    call: Call, objective: ObjectiveFn, params: list[nn.Parameter], divisor: float
) -> tuple[Grads, bool]:
    """``∇(S/d)`` for one call (rows reversed where allowed: not where the objective pairs
    its rows, as DPO's ``[chosen; rejected]``), and whether they were."""
    other = None if getattr(objective, "paired_rows", False) else reversed_call(call)
    if other is not None:
        try:
            return replay(other, objective, params, 1.0 / divisor)[0], True
        except Exception:  # a model that cannot take its rows reversed: scaling alone
            pass
    return replay(call, objective, params, 1.0 / divisor)[0], False


def add_into(ref: Grads, grads: Grads) -> None:
    """``ref += grads``; the first gradients are taken over, not copied, where no other
    parameter's gradient shares their memory (autograd may hand one tensor to several)."""
    storages = [g.untyped_storage().data_ptr() for g in grads if g is not None]
    shared = {p for p in storages if storages.count(p) > 1}
    for i, g in enumerate(grads):
        if g is None:
            continue
        if ref[i] is not None:
            ref[i].add_(g)  # type: ignore[union-attr]
            continue
        low = g.dtype in (torch.bfloat16, torch.float16)
        own = not low and g.is_contiguous() and g.untyped_storage().data_ptr() not in shared
        ref[i] = g if own else g.to(torch.float32 if low else g.dtype, copy=True)
        grads[i] = None  # the reference holds it now


def recompute(
    calls: list[Call],
    params: list[nn.Parameter],
    sampler: Sampler,
    objective: ObjectiveFn,
    *,
    wrt: list[torch.Tensor] | None = None,
    whole: Callable[[Grads], Grads] | None = None,
) -> LocalReference:
    """Replay ``calls`` (see the module docstring); the model, its buffers, ``.grad`` and the
    RNG streams are as they were on return. ``wrt``: for each of ``params``, the tensor to
    differentiate in its place where the engine's forward computes with another (FSDP2's
    unsharded parameters; :meth:`fullbatch._probe._applied.AppliedGradient.wrt`); ``whole``:
    what makes each replay's gradients whole tensors (a tensor-parallel ``DTensor`` gathered;
    :meth:`~fullbatch._probe._applied.AppliedGradient.whole`).

    The band's micro-batch (the one with most rows) runs first, before the reference buffer
    exists, so that at most two gradients are alive at any time: the reference and the one
    backward just produced (the band run's, once, beside the first).
    """
    early = calls[0].early if calls else None
    if early is not None and early.serves(calls):
        return _taken(early, params)
    rng = RngState()
    modules = list({id(c.module): c.module for c in calls}.values())
    buffers = [(b, b.detach().clone()) for m in modules for b in m.buffers()]
    where = {id(p): i for i, p in enumerate(params)}
    pick = [where[id(p)] for p in sampler.params]
    out = LocalReference(ref=[None] * len(params))
    samples: dict[int, torch.Tensor] = {}
    counts: dict[int, float] = {}
    widest = max(range(len(calls)), key=lambda i: rows_of([*calls[i].args, calls[i].kwargs]) or 0)
    order = [widest, *(i for i in range(len(calls)) if i != widest)]
    banded = False
    targets: list[Any] = list(params) if wrt is None else wrt
    made_whole = whole if whole is not None else (lambda grads: grads)
    try:
        with torch.enable_grad():
            for index in order:
                call = calls[index]
                grads, count = replay(call, objective, targets, 1.0)
                grads = made_whole(grads)
                samples[index] = sampler.take([grads[j] for j in pick])
                counts[index] = count
                if not banded and count > 0:
                    divisor = 3.0 * count * len(calls)  # like 1 / N: no power of two
                    again, out.band_rows_reversed = _band(call, objective, targets, divisor)
                    again = made_whole(again)
                    picked = sampler.take([again[j] for j in pick])
                    out.note_band(grads, again, samples[index], picked, divisor, count)
                    del again
                    banded = True
                add_into(out.ref, grads)
                del grads
    finally:
        with torch.no_grad():
            for buf, saved in buffers:
                buf.copy_(saved)
        rng.restore()
    out.samples = [samples[i] for i in range(len(calls))]
    out.counts = [counts[i] for i in range(len(calls))]
    return out


def _taken(early: Any, params: list[nn.Parameter]) -> LocalReference:
    """The window's reference as :mod:`fullbatch._probe._early` took it at the forwards, in
    ``params``' order (None for a parameter it did not differentiate)."""
    by_id = {id(p): g for p, g in zip(early.params, early.ref, strict=True)}
    return LocalReference(
        ref=[by_id.get(id(p)) for p in params],
        samples=list(early.samples),
        counts=list(early.counts),
        band=early.band,
        band_count=early.band_count,
        delta=early.delta,
    )


def _zeros(p: nn.Parameter) -> torch.Tensor:
    """Zeros of ``p``'s whole shape (a plain tensor, also for a ``DTensor`` or a partitioned
    parameter) in the dtype the reference keeps for it (low precision summed in float32)."""
    low = p.dtype in (torch.bfloat16, torch.float16)
    dtype = torch.float32 if low else p.dtype
    return torch.zeros(whole_shape(p), dtype=dtype, device=p.device)


def summed_over_ranks(
    local: LocalReference | None, params: list[nn.Parameter], sync: Any
) -> list[torch.Tensor]:
    """``Σ_rk ∇S_rk`` for each of ``params``: this rank's reference (zeros where it has none,
    e.g. a rank whose model did not run) summed over ``sync``'s ranks in place."""
    ref = local.ref[: len(params)] if local is not None else [None] * len(params)
    full = [_zeros(p) if r is None else r for p, r in zip(params, ref, strict=True)]
    if sync.world > 1:
        sum_tensors(full, sync.group)
    return full

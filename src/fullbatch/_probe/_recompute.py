"""Recompute a window's micro-batches under the declared objective, touching nothing.

Each recorded call is replayed (its RNG state restored before the forward, so dropout draws
the same masks; its autocast regions re-entered) and differentiated with
``torch.autograd.grad``, which hands the gradients back instead of accumulating them into
``.grad`` and runs no hook on the parameters' gradient accumulators (DDP's reducer hooks live
there). Buffers (BatchNorm statistics) and the RNG streams are put back afterwards.

The window's reference is ``Σ_k ∇S_k`` summed in one gradient-sized buffer (divided by the
window's count later, after the sum over ranks); each micro-batch also leaves the sampled
coordinates of its own ``∇S_k`` for the fit. The rounding band comes from the first micro-batch
with items, differentiated a second time as another engine would compute it: its loss scaled by
``1 / (n · K)`` before backward (as a per-micro-batch mean over ``K`` micro-batches would be), and
its rows reversed when that changes no dropout mask.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fullbatch._base._modelstate import _DROPOUT_ATTRIBUTES
from fullbatch._base._rng import RngState
from fullbatch._probe._capture import Call
from fullbatch._probe._norms import squared
from fullbatch._probe._objective import ObjectiveFn
from fullbatch._probe._sample import Sampler
from fullbatch._verify._arms import reverse_rows

__all__ = ["Recomputed", "recompute"]

Grads = list[torch.Tensor | None]


@dataclass
class Recomputed:
    """One rank's share of a window: ``ref[i] = Σ_k ∇S_k`` for ``params[i]`` (not divided),
    each call's sampled ``∇S_k`` and count, and the band run's absolute deviation."""

    ref: Grads
    samples: list[torch.Tensor] = field(default_factory=list)
    counts: list[float] = field(default_factory=list)
    band: float = 0.0
    band_rows_reversed: bool = False


@contextlib.contextmanager
def _replaying(call: Call) -> Iterator[None]:
    call.rng.restore()
    regions = dict(call.autocast)
    with contextlib.ExitStack() as stack:
        devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
        for device in devices:
            if device in regions:
                stack.enter_context(torch.autocast(device, dtype=regions[device]))
            elif torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


def _dropout_active(module: nn.Module) -> bool:
    for m in module.modules():
        if not m.training:
            continue
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            return True
        if any(isinstance(v := getattr(m, a, None), float) and v > 0 for a in _DROPOUT_ATTRIBUTES):
            return True
    return False


def _rows(values: list[Any]) -> int | None:
    """The common first dimension of every tensor in ``values`` (nested one level), or None."""
    sizes = set()
    for value in values:
        inner = (
            value.values()
            if isinstance(value, dict)
            else (value if isinstance(value, (list, tuple)) else [value])
        )
        for t in inner:
            if isinstance(t, torch.Tensor) and t.dim() > 0:
                sizes.add(t.shape[0])
    return sizes.pop() if len(sizes) == 1 else None


def _reversed(call: Call) -> Call | None:
    """The call with its rows in reverse order, when that is the same math with other rounding."""
    parts = [*call.args, call.kwargs, call.micro]
    rows = _rows(parts)
    if rows is None or rows < 2 or _dropout_active(call.module):
        return None
    return Call(
        module=call.module,
        wrapper=call.wrapper,
        args=reverse_rows(call.args, rows),
        kwargs=reverse_rows(call.kwargs, rows),
        rng=call.rng,
        autocast=call.autocast,
        micro=reverse_rows(call.micro, rows),
    )


def _grads(loss: torch.Tensor, params: list[nn.Parameter]) -> Grads:
    if not loss.requires_grad:
        return [None] * len(params)
    try:
        return list(torch.autograd.grad(loss, params, allow_unused=True))
    except RuntimeError as error:
        if "heckpoint" in str(error):
            raise RuntimeError(
                "the model uses reentrant activation checkpointing, which the probe's "
                "torch.autograd.grad cannot differentiate through; use non-reentrant "
                "checkpointing (gradient_checkpointing_kwargs={'use_reentrant': False}, or "
                "torch.utils.checkpoint(..., use_reentrant=False))."
            ) from error
        raise


def _run(
    call: Call, objective: ObjectiveFn, params: list[nn.Parameter], scale: float
) -> tuple[Grads, float]:
    with _replaying(call):
        loss, count = objective(call.module, call)
    return _grads(loss * scale if scale != 1.0 else loss, params), count


def _band(
    call: Call, objective: ObjectiveFn, params: list[nn.Parameter], grads: Grads, divisor: float
) -> tuple[float, bool]:
    """``‖∇(S/d)·d − ∇S‖`` for one call (rows reversed where allowed), and whether they were."""
    other = _reversed(call)
    again = None
    if other is not None:
        try:
            again, _ = _run(other, objective, params, 1.0 / divisor)
        except Exception:  # a model that cannot take its rows reversed: scaling alone
            again = None
    reversed_rows = again is not None
    if again is None:
        again, _ = _run(call, objective, params, 1.0 / divisor)
    return math.sqrt(squared(again, grads, scale=divisor)), reversed_rows


def _add(ref: Grads, grads: Grads) -> None:
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
    calls: list[Call], params: list[nn.Parameter], sampler: Sampler, objective: ObjectiveFn
) -> Recomputed:
    """Replay ``calls`` (see the module docstring); the model, its buffers, ``.grad`` and the
    RNG streams are as they were on return.

    The band's micro-batch (the one with most rows) runs first, before the reference buffer
    exists, so that at most two gradients are alive at any time: the reference and the one
    backward just produced.
    """
    rng = RngState()
    modules = list({id(c.module): c.module for c in calls}.values())
    buffers = [(b, b.detach().clone()) for m in modules for b in m.buffers()]
    where = {id(p): i for i, p in enumerate(params)}
    pick = [where[id(p)] for p in sampler.params]
    out = Recomputed(ref=[None] * len(params))
    samples: dict[int, torch.Tensor] = {}
    counts: dict[int, float] = {}
    widest = max(range(len(calls)), key=lambda i: _rows([*calls[i].args, calls[i].kwargs]) or 0)
    order = [widest, *(i for i in range(len(calls)) if i != widest)]
    banded = False
    try:
        with torch.enable_grad():
            for index in order:
                call = calls[index]
                grads, count = _run(call, objective, params, 1.0)
                samples[index] = sampler.take([grads[j] for j in pick])
                counts[index] = count
                if not banded and count > 0:
                    divisor = 3.0 * count * len(calls)  # like 1 / N: no power of two
                    out.band, out.band_rows_reversed = _band(
                        call, objective, params, grads, divisor
                    )
                    banded = True
                _add(out.ref, grads)
                del grads
    finally:
        with torch.no_grad():
            for buf, saved in buffers:
                buf.copy_(saved)
        rng.restore()
    out.samples = [samples[i] for i in range(len(calls))]
    out.counts = [counts[i] for i in range(len(calls))]
    return out

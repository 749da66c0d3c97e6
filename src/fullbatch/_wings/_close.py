"""The one window-close of the framework wings: read the totals, decide, then step or skip.

Every wing that hands its step to a framework — ``fullbatch.hf.ExactTrainer`` and the TRL
trainers, Lightning's ``ExactAccumulation``, ``fullbatch.super_gradients.ExactTrainer``,
``fullbatch.deepspeed.ExactEngine``, ``fb.Pipeline`` — ends its window with the same three
moves:

1. :func:`read_totals`: the window's sums (loss sum, count, extras), reduced over ranks by the
   framework's own collective, and the squared norm of the gradients as accumulated, read on
   the host together (the one host sync of the window);
2. :func:`close_window`: :func:`fullbatch._base._verdict.decide`, then on a step the
   gradients are multiplied by the verdict's factor (and clip, where the wing clips) and the
   step is counted; on a skip the wing's ``skip`` action runs (what its framework needs so
   that parameters, optimizer state and LR schedule stay as they were) and the skip is
   counted and warned about;
3. for a framework that steps the optimizer and the scheduler after the wing's hook whatever
   happens (the Hugging Face Trainer, Lightning), :func:`skip_framework_step` is that action:
   every ``.grad`` set to ``None`` (torch optimizers leave such parameters and their state
   alone, and the framework's clipping finds nothing) and the schedule kept, to be restored
   after the framework's scheduler step.

The contract a wing fills (``c``, ``W``, what the totals mean) is in
:mod:`fullbatch._base._verdict`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from fullbatch._base._normalize import scale_grads, squared_norm
from fullbatch._base._schedule import KeptSchedule
from fullbatch._base._verdict import Verdict, WindowCounters, WindowTotals, decide

__all__ = ["Wing", "close_window", "read_totals", "skip_framework_step"]


@dataclass(frozen=True)
class Wing:
    """What the window-close needs to know about the wing it closes for.

    Attributes:
        counters: the wing's :class:`WindowCounters` (steps, skipped windows, the warning).
        report: where the user reads the counters, quoted by the skip warning.
        through: the framework packages between the user's line and the wing's hook, so the
            warning points at the user's ``trainer.train()``.
        scaler: a GradScaler is on (the warning says a few skips are expected).
        clips: the wing applies the verdict's clip itself (otherwise its framework clips).
    """

    counters: WindowCounters
    report: str
    through: tuple[str, ...] = ()
    scaler: bool = False
    clips: bool = False


def read_totals(
    local: torch.Tensor,
    grads: list[torch.Tensor],
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    *,
    shard_copies: float | None = None,
) -> list[float]:
    """``[*reduce(local), squared norm of grads]`` as floats, in one host sync.

    ``local``: this rank's float64 window sums (1-dim); ``reduce``: the framework's sum over
    ranks (``None`` on one process). The gradients are taken as they are on this rank: a
    replicated model after its all-reduce holds the whole gradient. Sharded gradients (FSDP2):
    ``shard_copies`` ranks hold each shard, and the squared norm of this rank's shards, divided
    by it, is summed over the ranks with the rest.

    >>> g = [torch.tensor([3.0, 4.0])]
    >>> read_totals(torch.tensor([6.0, 2.0], dtype=torch.float64), g, lambda t: 2 * t)
    [12.0, 4.0, 25.0]
    >>> read_totals(torch.tensor([6.0], dtype=torch.float64), g, lambda t: 2 * t, shard_copies=1)
    [12.0, 50.0]
    """
    sq = squared_norm(grads, local.device).to(local).reshape(1)
    if shard_copies is not None:
        local = torch.cat([local.reshape(-1), sq / shard_copies])
        return (local if reduce is None else reduce(local)).tolist()
    if reduce is not None:
        local = reduce(local)
    return torch.cat([local.reshape(-1), sq]).tolist()


def close_window(
    totals: WindowTotals,
    wing: Wing,
    grads: list[torch.Tensor] | None = None,
    skip: Callable[[Verdict], None] | None = None,
) -> Verdict:
    """Decide the window, then scale ``grads`` and count a step, or skip and count a skip.

    ``grads``: the gradients to multiply by the verdict's factor (times its clip when
    ``wing.clips``); ``None`` where they are already the window's (a loss scaled up front).
    ``skip``: what the wing's framework needs on a skip (``None``: the wing itself does not
    step).

    >>> counters = WindowCounters()
    >>> g = [torch.ones(2)]
    >>> v = close_window(WindowTotals(loss=4.0, count=2.0, squared_norm=2.0), Wing(counters,
    ...     "wing.skipped_windows"), g)
    >>> v.factor, g[0].tolist(), counters.steps
    (0.5, [0.5, 0.5], 1)
    """
    verdict = decide(totals)
    counters = wing.counters
    if not verdict.skipped:
        if grads is not None:
            scale_grads(grads, verdict.factor * (verdict.clip if wing.clips else 1.0))
        counters.stepped()
        return verdict
    if skip is not None:
        skip(verdict)
    counters.skipped(
        counters.windows,
        str(verdict.reason),
        report=wing.report,
        scaler=wing.scaler,
        through=wing.through,
    )
    return verdict


def skip_framework_step(
    params: Iterable[torch.nn.Parameter],
    schedulers: Iterable[Any],
    param_groups: Iterable[dict[str, Any]],
    *,
    keep_grads: bool = False,
) -> KeptSchedule:
    """Make the framework's coming optimizer step a no-op; the schedule to put back after it.

    ``keep_grads``: leave the (non-finite) gradients for a GradScaler, which then skips the
    optimizer step itself and backs off its scale.
    """
    if not keep_grads:
        for p in params:
            p.grad = None
    return KeptSchedule(schedulers, param_groups)

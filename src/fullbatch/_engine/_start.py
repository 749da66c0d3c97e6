"""The window-start exchange: what every rank must know before a window's first backward.

One tiny all-gather under DDP/FSDP2 (none locally) carries, per rank: its real micro-batches,
whether its window is full (``partial_window="drop"``), whether it can pad, an estimate of its
items (the first window's ``c``), whether gradients are present, its resume checks
(:mod:`fullbatch._engine._resume_check`) and its ``counts=`` totals. From it every rank
decides the same things: a resume that does not fit (every rank raises), the end of the data,
a dropped tail, how many padding micro-batches each rank runs, ``c`` and ``window.totals``.

Reading the gathered table is a host synchronization when the backend keeps it on an
accelerator (NCCL); locally and under gloo it is a host tensor. On an accelerator every rank
reads it when a decision before the first backward needs everyone's row: the first window of
``acc.windows(loader)`` (a rank with nothing to pad with fails there, on every rank, and so do
the resume checks; after it every rank can pad), the first ``c``, ``partial_window="drop"``,
equal micro-batch counts (FSDP2, DDP's static graph), ``counts=`` (``window.totals`` are
numbers) and "auto". Otherwise only a rank without a real micro-batch (to pad, or to end with
the others), with gradients already present or with a resume problem (to refuse them) reads
it; the others go on without waiting. A mistake on one rank only then fails there first, and
the others at their next collective (within the process-group timeout), as any rank's error
does; the same mistake on every rank (the usual case: the same code runs everywhere) fails
everywhere when the window opens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from fullbatch._base._normalize import check_count, estimate_items, power_of_two_scale
from fullbatch._engine._core import Engine
from fullbatch._engine._feed import Feed, Stream
from fullbatch._engine._resume_check import WIDTH, ResumeCheck

__all__ = ["Start", "start_window"]

# Slots of the window-start all-gather: one row per rank; the resume checks' WIDTH slots
# follow, then the counts= totals and the number of bad counts among them.
_REAL, _FULL, _CAN_PAD, _HINT, _GRADS = range(5)
_RESUME = 5


@dataclass(frozen=True, slots=True)
class Start:
    """What the exchange decided: ``c`` and ``window.totals``."""

    loss_scale: float
    totals: dict[str, float] | None
    padding: int = 0  # padding micro-batches over every rank (the same on every rank)


def _everyone_reads(engine: Engine, index: int) -> bool:
    """Whether a decision before the first backward needs every rank's row (see above)."""
    return (
        engine.sync.device.type == "cpu"  # locally and under gloo: reading it costs nothing
        or index == 0
        or engine.loss_scale is None
        or engine.pending is not None
        or engine.micro_plan.decides_at_start
        or engine.sync.equal_micro_batches
    )


def start_window(
    engine: Engine, feed: Feed, stream: Stream, *, index: int, resume: ResumeCheck
) -> Start | Literal[False] | None:
    """The window-start exchange: one tiny all-gather under DDP/FSDP2, none locally.

    ``resume``: this rank's resume checks; when any rank's fails, every rank raises
    :class:`~fullbatch._engine._resume_check.ResumeMismatch` (before anything changes).

    Returns None at the end of the data, False for a dropped window, else :class:`Start`.
    """
    sync = engine.sync
    real = feed.real
    grads = any(p.grad is not None for p in engine.params)
    # The first window's c comes from an estimate of its items (all ranks together).
    plan = engine.micro_plan
    expected = len(real) if feed.read_all else plan.micro_batches or 1
    hint = estimate_items(real[0]) * expected if real and engine.loss_scale is None else 0.0
    can_pad = plan.padding_micro_batch is not None or stream.last is not None
    row = [
        float(len(real)),
        float(feed.full if plan.drop else True),
        float(can_pad),
        hint,
        float(grads),
        *resume.row(),
    ]
    names = list(plan.counts or {})
    if sync.group is None:
        table = [row + (_local_totals(engine, real).tolist() if names else [])]  # one read
    else:
        # Host numbers go to the collective's device without waiting (non_blocking); the
        # counts= totals are already there.
        mine = torch.tensor(row, dtype=torch.float64).to(sync.device, non_blocking=True)
        if names:
            local = _local_totals(engine, real).to(sync.device, non_blocking=True)
            mine = torch.cat([mine, local])
        gathered = sync.all_gather(mine)
        quiet = not grads and not resume.problems
        if real and quiet and not _everyone_reads(engine, index):
            assert engine.loss_scale is not None  # else everyone reads
            return Start(engine.loss_scale, None)  # nothing to decide on this rank
        table = gathered.tolist()  # the window start's one read (a host tensor on gloo)
    rows = [r[: len(row)] for r in table]
    need = engine.sync.padding([int(r[_REAL]) for r in rows])
    have = [int(r[_REAL]) + n for r, n in zip(rows, need, strict=True)]
    resume.verdict([r[_RESUME : _RESUME + WIDTH] for r in rows], have)
    if not any(r[_REAL] for r in rows):
        return None
    if any(r[_GRADS] for r in rows):
        raise RuntimeError(
            "gradients are already present when a window starts; fullbatch accumulates "
            "from zero. Call optimizer.zero_grad(set_to_none=True) before the loop, or "
            "window.discard() to abandon a window."
        )
    if plan.drop and not all(r[_FULL] for r in rows):
        return False
    _pad(engine, feed, rows, stream, need)
    if engine.loss_scale is None:
        engine.loss_scale = power_of_two_scale(sum(r[_HINT] for r in rows))
    totals = _totals(names, [r[len(row) :] for r in table]) if names else None
    return Start(engine.loss_scale, totals, sum(need))


def _totals(names: list[str], ranks: list[list[float]]) -> dict[str, float]:
    """``window.totals`` from every rank's totals and bad-count flag."""
    *sums, bad = [sum(column) for column in zip(*ranks, strict=True)]
    if bad:
        raise ValueError(
            f"a counts= function returned a negative or non-finite count ({int(bad)} such "
            "value(s) in this window, over all ranks). A count is the number (or total "
            "weight) of items a loss sums over: a finite number >= 0."
        )
    return dict(zip(names, sums, strict=True))


def _pad(
    engine: Engine, feed: Feed, rows: list[list[float]], stream: Stream, need: list[int]
) -> None:
    mine = engine.sync.rank
    if not any(need):
        return
    stuck = [
        rank for rank, (n, r) in enumerate(zip(need, rows, strict=True)) if n and not r[_CAN_PAD]
    ]
    if stuck:
        raise ValueError(
            f"rank(s) {stuck} have no micro-batch in this window and nothing to pad with. "
            "Give the Accumulator padding_micro_batch=lambda: <a micro-batch>, or give "
            "every rank data (e.g. DistributedSampler(..., drop_last=False))."
        )
    make = engine.micro_plan.padding_micro_batch or (lambda: stream.last)
    feed.add_padding(need[mine], make)


def _local_totals(engine: Engine, real: list[Any]) -> torch.Tensor:
    """This rank's ``counts=`` totals and its number of bad device counts, one float64 tensor.

    Python numbers and CPU tensors are checked as they come; counts on an accelerator are
    summed where they live and checked with the totals' one read, never read one by one.
    """
    f64 = torch.float64
    columns: list[float | torch.Tensor] = []
    on_device: list[torch.Tensor] = []
    for fn in (engine.micro_plan.counts or {}).values():
        total = 0.0
        found: list[torch.Tensor] = []
        for micro in real:
            value = check_count(fn(micro))
            if isinstance(value, torch.Tensor):
                found.append(value)
            else:
                total += value
        if found:
            where = found[0].device
            columns.append(torch.stack([v.to(where, f64) for v in found]).sum() + total)
        else:
            columns.append(total)
        on_device += found
    if not on_device:
        return torch.tensor([*columns, 0.0], dtype=f64)
    where = on_device[0].device
    zero = torch.zeros((), dtype=f64, device=where)
    values = torch.stack([v.to(where, f64) for v in on_device])
    bad = (~torch.isfinite(values) | (values < 0)).sum().to(f64)
    return torch.stack([zero + c if isinstance(c, float) else c.to(where) for c in columns] + [bad])

"""The window-start exchange: what every rank must know before a window's first backward.

One tiny all-gather under DDP/FSDP2 (none locally) carries, per rank: its real micro-batches,
whether its window is full (``partial_window="drop"``), whether it can pad, an estimate of its
items (the first window's ``c``), whether gradients are present, its resume checks
(:mod:`fullbatch._engine._resume_check`) and its ``counts=`` totals. From it every rank
decides the same things: a resume that does not fit (every rank raises), the end of the data,
a dropped tail, how many padding micro-batches each rank runs, ``c`` and ``window.totals``.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from fullbatch._base._normalize import check_count, estimate_items, power_of_two_scale
from fullbatch._engine._core import Engine
from fullbatch._engine._feed import Feed, Stream
from fullbatch._engine._resume_check import WIDTH, ResumeCheck

__all__ = ["start_window"]

# Slots of the window-start all-gather: one row per rank; the resume checks' WIDTH slots follow.
_REAL, _FULL, _CAN_PAD, _HINT, _GRADS = range(5)
_RESUME = 5


def start_window(
    engine: Engine, feed: Feed, stream: Stream, *, resume: ResumeCheck
) -> tuple[float, dict[str, float] | None] | Literal[False] | None:
    """The window-start exchange: one tiny all-gather under DDP/FSDP2, none locally.

    ``resume``: this rank's resume checks; when any rank's fails, every rank raises
    :class:`~fullbatch._engine._resume_check.ResumeMismatch` (before anything changes).

    Returns None at the end of the data, False for a dropped window, else ``(c, totals)``.
    """
    real = feed.real
    grads = any(p.grad is not None for p in engine.params)
    # The first window's c comes from an estimate of its items (all ranks together).
    expected = len(real) if feed.read_all else engine.micro_batches or 1
    hint = estimate_items(real[0]) * expected if real and engine.loss_scale is None else 0.0
    can_pad = engine.padding_micro_batch is not None or stream.last is not None
    row = [
        float(len(real)),
        float(feed.full if engine.partial_window == "drop" else True),
        float(can_pad),
        hint,
        float(grads),
        *resume.row(),
    ]
    names = list(engine.counts or {})
    local_totals = _local_totals(engine, real) if engine.counts is not None else []
    table = engine.sync.all_gather(torch.tensor(row + local_totals, dtype=torch.float64))
    rows = table.tolist()
    need = _need(engine, rows)
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
    if engine.partial_window == "drop" and not all(r[_FULL] for r in rows):
        return False
    _pad(engine, feed, rows, stream, need)
    if engine.loss_scale is None:
        engine.loss_scale = power_of_two_scale(sum(r[_HINT] for r in rows))
    totals = None
    if engine.counts is not None:
        sums = table[:, len(row) :].sum(dim=0).tolist()
        totals = dict(zip(names, sums, strict=True))
    return engine.loss_scale, totals


def _need(engine: Engine, rows: list[list[float]]) -> list[int]:
    """The padding micro-batches each rank runs in this window."""
    if engine.sync.equal_micro_batches:
        return [int(max(r[_REAL] for r in rows) - r[_REAL]) for r in rows]
    if engine.sync.kind == "ddp" and not engine.sync.reduce_at_step:
        return [int(r[_REAL] == 0) for r in rows]  # DDP's reduce needs one backward per rank
    return [0 for _ in rows]


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
    make = engine.padding_micro_batch or (lambda: stream.last)
    feed.add_padding(need[mine], make)


def _local_totals(engine: Engine, real: list[Any]) -> list[float]:
    totals = []
    for fn in (engine.counts or {}).values():
        total = 0.0
        for micro in real:
            value = check_count(fn(micro))
            total += float(value)
        totals.append(total)
    return totals

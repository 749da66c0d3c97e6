"""``WindowState``: the whole state of one window in one typed value.

A window is opened by :func:`fullbatch._engine._open.open_window` (the plain loop,
``window.run``, an "auto" retry, ``run_coupled`` and a resumed window all go through it) and
ended by :func:`fullbatch._engine._open.end_window` (stepped, skipped, discarded or abandoned).
The engine's current window is ``engine.window``, written only there. The user's
:class:`fullbatch.Window` is a handle on the value; the drivers (``window.run``, "auto",
``run_coupled``) go through the handle (``fullbatch._engine._core.Handle``). A checkpoint
inside a window is the value's :meth:`WindowState.to_dict`, resumed by
:meth:`WindowState.from_dict`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from fullbatch._engine._feed import Feed, Stream

__all__ = ["Phase", "WindowState"]


class Phase(enum.Enum):
    """Where a window stands. Ended phases say how it ended."""

    OPEN = "open"  # opened; not iterated yet
    ITERATING = "iterating"  # handing out micro-batches
    EXHAUSTED = "exhausted"  # every micro-batch handed out
    STEPPING = "stepping"  # window.step() has begun: no further call on the window
    STEPPED = "stepped"  # ended by an optimizer step
    SKIPPED = "skipped"  # ended by a skipped step (no items, non-finite loss or gradient)
    DISCARDED = "discarded"  # ended by window.discard()
    ABANDONED = "abandoned"  # ended by an error (the user's function, a guard, a retry)

    closed: bool  # no call on the window is accepted any more (set below: a plain attribute,
    # read on every micro-batch)


for _phase in Phase:
    _phase.closed = _phase not in (Phase.OPEN, Phase.ITERATING, Phase.EXHAUSTED)


@dataclass(slots=True, eq=False)
class WindowState:
    """One window: its micro-batches, where iteration stands and what was accumulated.

    >>> state = WindowState(Feed([1, 2]), index=0, loss_scale=0.5, totals=None)
    >>> state.phase, state.yielded, state.count_py
    (<Phase.OPEN: 'open'>, 0, 0.0)
    >>> state.to_dict()["micro_batches_done"]
    0
    """

    feed: Feed
    index: int
    loss_scale: float  # c: every count-form loss is seeded with it
    totals: dict[str, float] | None  # the counts= totals over ranks
    padding: int = 0  # padding micro-batches this window runs over every rank
    stream: Stream | None = None  # the loader's stream ("auto" re-cuts and pads from it)
    loader_items: int = 0  # loader items consumed before this window began
    first_item: Any = None  # the window's first loader item (None: none on this rank)
    phase: Phase = Phase.OPEN
    by_run: bool = False  # driven by window.run / run_coupled (needed by "auto")
    totals_read: bool = False  # window.totals was read (a share may be divided by it)
    yielded: int = 0
    current_final: bool = False  # the current micro-batch is the window's last
    current_padding: bool = False  # the current micro-batch is padding
    current_backwards: int = 0
    final_backward: bool = False
    backwards: int = 0
    form: str | None = None  # "count" or "share"
    losses: list[torch.Tensor] = field(default_factory=list)
    count_py: float = 0.0
    device_counts: list[torch.Tensor] = field(default_factory=list)
    seeds: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)  # window.stats results, by key
    stats_seconds: float = 0.0  # time this rank spent in window.stats pre-passes

    def sums(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """``(loss sum, device-tensor count sum, number of bad device counts)`` in ``dtype``."""
        zero = torch.zeros((), dtype=dtype, device=device)
        loss = _total(self.losses, device, dtype) if self.losses else zero
        if not self.device_counts:
            return loss, zero, zero
        counts = torch.stack([c.to(device, dtype) for c in self.device_counts])
        bad = (~torch.isfinite(counts) | (counts < 0)).sum().to(dtype)
        return loss, counts.sum(), bad

    def to_dict(self) -> dict[str, Any]:
        """The window's progress as tensors, numbers and strings (a checkpoint's ``window``)."""
        return {
            "micro_batches_done": self.yielded,
            "loss_scale": self.loss_scale,
            "backwards": self.backwards,
            "form": self.form,
            "final_backward": self.final_backward,
            "losses": [t.clone() for t in self.losses],
            "count": self.count_py,
            "device_counts": [t.clone() for t in self.device_counts],
            "stats": dict(self.stats),  # window statistics: never recomputed on resume
        }

    @classmethod
    def from_dict(cls, saved: dict[str, Any], opened: WindowState) -> WindowState:
        """``opened`` (the same window, opened again from the same items) with ``saved``'s
        progress; its micro-batches already done must have been taken from the feed."""
        return replace(
            opened,
            yielded=int(saved["micro_batches_done"]),
            backwards=int(saved["backwards"]),
            form=saved["form"],
            final_backward=bool(saved["final_backward"]),
            losses=list(saved["losses"]),
            count_py=float(saved["count"]),
            device_counts=list(saved["device_counts"]),
            seeds={},
            stats=dict(saved.get("stats", {})),
        )


def _total(values: list[torch.Tensor], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Sum of 0-dim tensors in ``dtype`` (one stack when they share a dtype and device)."""
    if all(v.dtype == values[0].dtype and v.device == values[0].device for v in values):
        return torch.stack(values).to(device, dtype).sum()
    return torch.stack([v.to(device, dtype) for v in values]).sum()

"""``WindowState``: the whole state of one window in one typed value.

The user's :class:`fullbatch.Window` is a handle on it; the step (``_step``) and checkpoints
(``_resume``) read it, the drivers (``window.run``, "auto" retries, ``run_coupled``) go through
the handle (:class:`Handle`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from fullbatch._base._stats import StepStats
from fullbatch._engine._core import Engine
from fullbatch._engine._feed import Feed, Stream

__all__ = ["Handle", "WindowState"]


@dataclass(slots=True, eq=False)
class WindowState:
    """One window: its micro-batches, where iteration stands and what was accumulated.

    >>> state = WindowState(Feed([1, 2]), index=0, loss_scale=0.5, totals=None)
    >>> state.yielded, state.closed, state.count_py
    (0, False, 0.0)
    """

    feed: Feed
    index: int
    loss_scale: float  # c: every count-form loss is seeded with it
    totals: dict[str, float] | None  # the counts= totals over ranks
    stream: Stream | None = None  # the loader's stream ("auto" re-cuts and pads from it)
    iterated: bool = False
    by_run: bool = False  # iterated by window.run (needed by micro_batch_size="auto")
    yielded: int = 0
    exhausted: bool = False
    closed: bool = False  # stepped, discarded or abandoned
    current_final: bool = False
    current_padding: bool = False
    current_backwards: int = 0
    final_backward: bool = False
    backwards: int = 0
    form: str | None = None  # "count" or "share"
    losses: list[torch.Tensor] = field(default_factory=list)
    count_py: float = 0.0
    device_counts: list[torch.Tensor] = field(default_factory=list)
    seeds: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = field(default_factory=dict)

    def sums(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """``(loss sum, device-tensor count sum, number of bad device counts)`` in ``dtype``."""
        zero = torch.zeros((), dtype=dtype, device=device)
        loss = _total(self.losses, device, dtype) if self.losses else zero
        if not self.device_counts:
            return loss, zero, zero
        counts = torch.stack([c.to(device, dtype) for c in self.device_counts])
        bad = (~torch.isfinite(counts) | (counts < 0)).sum().to(dtype)
        return loss, counts.sum(), bad


def _total(values: list[torch.Tensor], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Sum of 0-dim tensors in ``dtype`` (one stack when they share a dtype and device)."""
    if all(v.dtype == values[0].dtype and v.device == values[0].device for v in values):
        return torch.stack(values).to(device, dtype).sum()
    return torch.stack([v.to(device, dtype) for v in values]).sum()


class Handle(Protocol):
    """What the drivers use of a window: the user's own calls, plus its engine and state."""

    _engine: Engine
    _state: WindowState

    def __iter__(self) -> Iterator[Any]: ...

    def backward(self, loss: torch.Tensor, count: Any = None, **autograd_kwargs: Any) -> None: ...

    def step(self) -> StepStats: ...

    @property
    def is_padding(self) -> bool: ...

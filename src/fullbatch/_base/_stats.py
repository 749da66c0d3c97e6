"""``StepStats``: what one window's step did, as plain Python numbers."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["StepStats"]


@dataclass(frozen=True)
class StepStats:
    """The result of :meth:`fullbatch.Window.step`, identical on every data-parallel rank.

    Attributes:
        loss: the window's loss, ``Σ loss sums / Σ counts`` over all micro-batches and ranks
            (with count-less ``backward(share)`` calls: the sum of the shares). NaN when the
            window counted zero items.
        count: ``N``, the items counted over the window and all ranks (NaN in share mode).
        grad_norm: total 2-norm of the normalized gradient *before* clipping (NaN when the
            step was skipped before the norm was computed, e.g. zero items).
        skipped: True when parameters, optimizer state and scheduler were left untouched.
        reason: why it was skipped (``None`` when it was not).
        steps: optimizer steps taken so far, this one included.
        loss_scale: ``c``, the constant every loss was multiplied by before backward
            (1.0 in share mode); the gradient was multiplied by ``W / (c·N)`` at the step.
        lr: learning rate of the first parameter group used for this step.
        micro_batches: micro-batches this rank ran in the window, padding included.
        totals: ``window.totals`` when the Accumulator has ``counts=``; else empty.
        skipped_windows: windows skipped so far, this one included (each skip also warns, at
            the 1st, 2nd, 4th, 8th, ... skip).
        retries: how many times ``window.run`` re-ran this window with a smaller micro-batch
            size after an out-of-memory error (``micro_batch_size="auto"``); else 0.
        stats_seconds: seconds this rank spent in ``window.stats`` pre-passes for this window
            (0.0 without them).
    """

    loss: float
    count: float
    grad_norm: float
    skipped: bool
    reason: str | None
    steps: int
    loss_scale: float
    lr: float | None
    micro_batches: int
    totals: dict[str, float] = field(default_factory=dict)
    skipped_windows: int = 0
    retries: int = 0
    stats_seconds: float = 0.0

    def __str__(self) -> str:
        if self.skipped:
            return f"step {self.steps}: skipped ({self.reason})"
        norm = "nan" if math.isnan(self.grad_norm) else f"{self.grad_norm:.4g}"
        items = "from shares" if math.isnan(self.count) else f"over {self.count:g} items"
        return f"step {self.steps}: loss {self.loss:.4f} {items}, grad norm {norm}"


# Reprs and pickles say fullbatch.StepStats, wherever the class is defined; doctest still
# finds its examples here.
StepStats.__module__ = "fullbatch"
__test__ = {"StepStats": StepStats}

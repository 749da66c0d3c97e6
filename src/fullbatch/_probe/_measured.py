"""What one window's check measured, before the judge names it (:class:`Measured`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from fullbatch._probe._engines import Engine
from fullbatch._probe._fit import Fit

__all__ = ["NO_FIT", "Measured"]

NO_FIT = Fit(())


@dataclass(frozen=True)
class Measured:
    """One window's numbers; :func:`fullbatch._probe._judge.judge` decides what they mean.

    Attributes:
        step: which optimizer step ended the window (1 for the first seen in the block).
        engine: who stepped the optimizer.
        objective: the declared objective's name.
        error: ``‖applied − reference‖ / ‖reference‖`` (before any clip).
        band: the model's rounding band, relative to the window's gradient.
        tolerance: what ``error`` is held to (``fullbatch._proof._tolerance.tolerance``).
        ranks: micro-batches per rank.
        counts: each micro-batch's item count, rank by rank.
        count: ``N``, the window's item count over every rank.
        fit: the weights, the factor, the leftover and their precisions.
        unit: the coherent rounding a right engine is allowed: the unit roundoff of the least
            precise dtype the window's gradient flows through (the gradient's, the parameters',
            an autocast region's; at least float32's).
        applied_norm: ``‖applied‖`` as the optimizer will apply it (after any clip).
        ranks_differ: the largest relative difference between ranks' applied gradients.
        clip: ``(max_norm, total_norm)`` of the clip the window saw, or None.
        problem, problem_pattern: why nothing could be judged (then everything else is moot).
    """

    step: int
    engine: Engine
    objective: str
    error: float = math.nan
    band: float = math.nan
    tolerance: float = math.nan
    ranks: tuple[int, ...] = (0,)
    counts: tuple[float, ...] = ()
    count: float = 0.0
    fit: Fit = NO_FIT
    unit: float = 0.0
    applied_norm: float = math.nan
    ranks_differ: float = 0.0
    clip: tuple[float, float] | None = None
    problem: str | None = None
    problem_pattern: str = "nothing to check"

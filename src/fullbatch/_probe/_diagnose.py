"""Name what went wrong in a window, from the weights of its micro-batches.

Two hypotheses explain the weights up to one constant factor ``c``: *uniform* (every
micro-batch weighted alike: right when ``c = 1``, "not normalized" otherwise, "partial window"
when ``c = k/K`` on a short window) and *mean of per-micro-batch means* (weights
``N / (W · K_r · n_k)``, each micro-batch's mean divided by its rank's micro-batch count and
averaged over ``W`` ranks). The one that fits best names the pattern; micro-batches off both
are "dropped" (weight 0), "counted twice" (weight 2), or listed with their weights.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from fullbatch._probe._fit import Fit
from fullbatch._probe._fixes import fix
from fullbatch._probe._where import Engine

__all__ = ["TOLERANCE", "Measured", "diagnose"]

#: Relative tolerance on a weight for it to match a pattern.
TOLERANCE = 0.05


@dataclass(frozen=True)
class Measured:
    """What one window's check measured, before it is named (see ``WindowCheck``)."""

    step: int
    engine: Engine
    objective: str
    ok: bool
    error: float
    band: float
    tolerance: float
    ranks: tuple[int, ...]
    counts: tuple[float, ...]
    count: float
    fit: Fit
    ranks_differ: float = 0.0
    clip: tuple[float, float] | None = None
    problem: str | None = None
    problem_pattern: str = "nothing to check"


def _where(m: Measured, k: int) -> str:
    """``micro-batch 3`` (1-based), with its rank when there are several."""
    if len(m.ranks) == 1:
        return f"micro-batch {k + 1}"
    start = 0
    for rank, n in enumerate(m.ranks):
        if k < start + n:
            return f"micro-batch {k - start + 1} of rank {rank}"
        start += n
    return f"micro-batch {k + 1}"


def _rank_sizes(m: Measured) -> list[int]:
    return [n for n in m.ranks for _ in range(n)]


def _hypotheses(m: Measured) -> dict[str, list[float]]:
    world = len(m.ranks)
    sizes = _rank_sizes(m)
    mean_of_means = [
        m.count / (world * size * n) if n > 0 else math.nan
        for size, n in zip(sizes, m.counts, strict=True)
    ]
    return {"uniform": [1.0] * len(m.counts), "mean of per-micro-batch means": mean_of_means}


def _factor(weights: tuple[float, ...], shape: list[float]) -> tuple[float, float]:
    """``(c, worst relative deviation)`` of ``weights ≈ c · shape`` over finite entries."""
    ratios = [w / s for w, s in zip(weights, shape, strict=True) if math.isfinite(w / s)]
    if not ratios:
        return math.nan, math.inf
    c = statistics.median(ratios)
    if c == 0:
        return 0.0, max(abs(r) for r in ratios)
    return c, max(abs(r - c) / abs(c) for r in ratios)


def _factor_text(c: float, k: int) -> str:
    if abs(c - k) <= TOLERANCE * k and k > 1:
        return f"x{c:.3g} (= K: the loss is not divided by the {k} micro-batches)"
    if abs(c * k - 1) <= TOLERANCE and k > 1:
        return f"x{c:.3g} (= 1/K: divided by the {k} micro-batches once too often)"
    return f"x{c:.3g} (a wrong unit or scale)"


def _outliers(m: Measured, shape: list[float], c: float) -> tuple[str, str] | None:
    """Micro-batches off ``c · shape``: all at 0 (dropped) or 2 (counted twice)."""
    off = [
        (k, w / (c * s))
        for k, (w, s) in enumerate(zip(m.fit.weights, shape, strict=True))
        if math.isfinite(w / s) and abs(w / (c * s) - 1) > TOLERANCE
    ]
    if not off:
        return None
    if all(abs(r) <= TOLERANCE for _, r in off):
        names = ", ".join(_where(m, k) for k, _ in off)
        return "dropped", f"dropped: {names} ran but contributed nothing (weight 0.00)"
    if all(abs(r - 2) <= 2 * TOLERANCE for _, r in off):
        names = ", ".join(_where(m, k) for k, _ in off)
        return "counted twice", f"counted twice: {names} weighted 2.00 (two backward passes)"
    return None


def _largest(m: Measured) -> str:
    devs = sorted(
        ((abs(w - 1), k, w) for k, w in enumerate(m.fit.weights) if math.isfinite(w)),
        reverse=True,
    )[:3]
    shown = ", ".join(f"{_where(m, k)} {w:.2f}" for _, k, w in devs)
    return f"largest deviating weights: {shown}" if shown else "no micro-batch weights"


def _weights_pattern(m: Measured, k_max: int) -> tuple[str, str]:
    k = len(m.counts)
    best_name, best = "", (math.nan, math.inf)
    for name, shape in _hypotheses(m).items():
        c, dev = _factor(m.fit.weights, shape)
        if dev < best[1] - 1e-9:
            best_name, best = name, (c, dev)
    c, dev = best
    if dev <= TOLERANCE and math.isfinite(c):
        short = k_max > k and abs(c - k / k_max) <= TOLERANCE * c
        if best_name == "mean of per-micro-batch means" and abs(c - 1) <= TOLERANCE:
            return best_name, (
                "mean of per-micro-batch means: each micro-batch's loss was averaged over its "
                "own items, so micro-batches weigh by 1/(their item count) instead of alike: "
                + _extremes(m)
            )
        if short:
            return "partial window", (
                f"partial window: this window has {k} micro-batches where others had {k_max}, "
                f"and it is weighted {c:.3g} = {k}/{k_max} of a full-batch step"
            )
        if abs(c - 1) <= TOLERANCE:
            return "right", "every micro-batch weighted right"
        what = _factor_text(c, max(m.ranks))
        if best_name == "mean of per-micro-batch means":
            return "mean of per-micro-batch means", (
                f"mean of per-micro-batch means, and not normalized: {what}; " + _extremes(m)
            )
        return "not normalized", f"not normalized: every micro-batch weighted {what}"
    shape = _hypotheses(m)["uniform"]
    named = _outliers(m, shape, 1.0)
    if named is not None:
        return named
    return "other", f"error {m.error:.2g}; {_largest(m)}"


def _extremes(m: Measured) -> str:
    finite = [(w, k) for k, w in enumerate(m.fit.weights) if math.isfinite(w)]
    if not finite:
        return ""
    (lo, klo), (hi, khi) = min(finite), max(finite)
    return (
        f"{_where(m, khi)} ({_items(m.counts[khi])}) weighted {hi:.2f}, "
        f"{_where(m, klo)} ({_items(m.counts[klo])}) {lo:.2f}"
    )


def _items(n: float) -> str:
    return f"{n:g} item" + ("" if n == 1 else "s")


def diagnose(m: Measured, k_max: int) -> tuple[str, str]:
    """``(pattern, sentence)`` for window ``m``; ``k_max``: most micro-batches of any window."""
    if m.problem is not None:
        return m.problem_pattern, m.problem
    if m.ok:
        return "right", (
            f"right: the applied gradient is the full-batch gradient of the declared objective "
            f"({m.objective}) over these {len(m.counts)} micro-batches ({m.engine.name})."
        )
    if m.ranks_differ > m.tolerance:
        pattern = "ranks differ"
        text = (
            f"ranks differ: the gradients about to be applied differ between ranks by "
            f"{m.ranks_differ:.2g} (relative), so the replicas would diverge"
        )
    elif abs(m.fit.leftover) > TOLERANCE:
        pattern = "leftover gradient"
        text = (
            f"leftover gradient: the window started with gradients from before it, kept with "
            f"weight {m.fit.leftover:.2f}"
        )
    else:
        pattern, text = _weights_pattern(m, k_max)
        if pattern == "right":  # weights right, error not: something outside the window
            pattern, text = (
                "other",
                (
                    f"error {m.error:.2g}, but every micro-batch is weighted right; "
                    f"{m.fit.unexplained:.0%} of the applied gradient is no combination of this "
                    "window's micro-batches (another loss term, or a gradient changed before step)"
                ),
            )
    return pattern, f"{text}. {fix(pattern, m.engine)}"

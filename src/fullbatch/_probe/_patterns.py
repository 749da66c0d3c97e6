"""The shapes a mistake leaves on the fitted weights, and which one the weights match.

Each hypothesis is a shape ``h_k`` the weights take up to one constant factor ``c``:

- *uniform*: every micro-batch alike (``h_k = 1``): right when ``c = 1``; a constant factor
  otherwise (a wrong divisor, a partial window weighted ``k/K``);
- *per-rank count*: each rank divided by its own item count ``N_r`` and the ranks' gradients
  averaged (``h_k = N / (W · N_r)``);
- *mean of per-micro-batch means*: each micro-batch's mean over its ``n_k`` items, divided by
  its rank's ``K_r`` micro-batches and averaged over ``W`` ranks (``h_k = N / (W · K_r · n_k)``).

Weights *match* a shape when every one lies within its margin of ``c · h_k``: ``Z`` standard
errors plus ``u + SLACK`` of ``c · h_k`` (the judge's constants; ``SLACK`` lets a pattern be named
when the weights print alike at two decimals). Nothing here decides right or wrong: the judge
(:mod:`fullbatch._probe._judge`) does, and names a pattern only where it agrees with that.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

__all__ = ["SLACK", "matching", "shapes"]

#: Relative slack of a pattern's shape, beyond the weights' precision (two printed decimals).
SLACK = 0.01


def _rank_of(ranks: Sequence[int]) -> list[int]:
    return [r for r, n in enumerate(ranks) for _ in range(n)]


def shapes(counts: Sequence[float], ranks: Sequence[int], count: float) -> dict[str, list[float]]:
    """Each hypothesis' shape ``h_k`` for a window (see the module docstring).

    >>> shapes([1.0, 3.0], [2], 4.0)["mean of per-micro-batch means"]
    [2.0, 0.6666666666666666]
    """
    world = len(ranks)
    owner = _rank_of(ranks)
    per_rank = [sum(n for n, r in zip(counts, owner, strict=True) if r == q) for q in range(world)]
    out = {"uniform": [1.0] * len(counts)}
    if world > 1:
        out["per-rank count"] = [
            count / (world * per_rank[r]) if per_rank[r] > 0 else math.nan for r in owner
        ]
    out["mean of per-micro-batch means"] = [
        count / (world * ranks[r] * n) if n > 0 else math.nan
        for n, r in zip(counts, owner, strict=True)
    ]
    return out


def matching(
    weights: Sequence[float], errors: Sequence[float], shape: Sequence[float], z: float, u: float
) -> float | None:
    """The factor ``c`` with which ``weights`` match ``shape`` (the median of their ratios), or
    None when one weight lies outside its margin of ``c · h_k``.

    >>> matching([0.5, 0.5], [0.0, 0.0], [1.0, 1.0], 4.0, 0.0)
    0.5
    >>> matching([0.5, 1.0], [0.0, 0.0], [1.0, 1.0], 4.0, 0.0) is None
    True
    """
    pairs = [
        (w, e, h)
        for w, e, h in zip(weights, errors, shape, strict=True)
        if math.isfinite(w) and math.isfinite(h) and h != 0
    ]
    if not pairs:
        return None
    c = statistics.median(w / h for w, _, h in pairs)
    for w, e, h in pairs:
        margin = z * (e if math.isfinite(e) else 0.0) + (u + SLACK) * abs(c * h)
        if abs(w - c * h) > margin:
            return None
    return c

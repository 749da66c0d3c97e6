"""Each micro-batch's effective weight in the applied gradient: a least-squares fit.

The applied gradient ``a`` (sampled coordinates) is fitted as ``Σ_k w_k ∇S_k + w_L L``: ``∇S_k``
the gradient of micro-batch ``k``'s summed loss, ``L`` the gradient that was present before the
window's first backward. The full batch gives ``w_k = 1 / N`` and ``w_L = 0``; the reported
weights are ``w_k · N`` (1.0 when right) and ``w_L`` (1.0: the old gradient was kept whole).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["Fit", "fit"]


@dataclass(frozen=True)
class Fit:
    """``weights`` (``w_k · N``; NaN for a micro-batch without gradient in the sampled
    coordinates), ``leftover`` (``w_L``, 0 without a leftover gradient) and ``unexplained``
    (``‖a − fit‖ / ‖a‖``: what no combination of the window's micro-batches explains)."""

    weights: tuple[float, ...]
    leftover: float
    unexplained: float


def fit(
    samples: torch.Tensor, leftover: torch.Tensor | None, applied: torch.Tensor, count: float
) -> Fit:
    """Least squares of ``applied`` on the rows of ``samples`` (and ``leftover``), float64.

    >>> g = torch.tensor([[1.0, 0.0, 1.0], [0.0, 2.0, 1.0]], dtype=torch.float64)
    >>> f = fit(g, None, (g[0] + 2 * g[1]) / 4, 4.0)
    >>> [round(w, 6) for w in f.weights], f.leftover, round(f.unexplained, 6)
    ([1.0, 2.0], 0.0, 0.0)
    """
    columns = [samples[k] for k in range(samples.shape[0])]
    has_leftover = leftover is not None and bool(leftover.abs().sum() > 0)
    if has_leftover:
        assert leftover is not None
        columns.append(leftover)
    norms = [float(c.norm()) for c in columns]
    live = [i for i, n in enumerate(norms) if n > 0]
    solved = [math.nan] * len(columns)
    a = applied.double()
    residual = a
    if not bool(torch.isfinite(a).all()) or not all(math.isfinite(n) for n in norms):
        live = []  # nothing to fit: the weights stay NaN
        residual = torch.full_like(a, math.nan)
    if live:
        matrix = torch.stack([columns[i] / norms[i] for i in live], dim=1)
        solution = torch.linalg.lstsq(matrix, a.unsqueeze(1), driver="gelsd").solution[:, 0]
        residual = a - matrix @ solution
        for j, i in enumerate(live):
            solved[i] = float(solution[j]) / norms[i]
    a_norm = float(a.norm())
    unexplained = float(residual.norm()) / a_norm if a_norm > 0 else 0.0
    k = samples.shape[0]
    weights = tuple(w * count for w in solved[:k])
    return Fit(weights, solved[k] if has_leftover else 0.0, unexplained)

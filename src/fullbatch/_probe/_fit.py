"""Each micro-batch's effective weight in the applied gradient, and how precisely the run
measures it: a least-squares fit with its own error bars.

The applied gradient ``a`` (sampled coordinates) is fitted as ``Σ_k w_k ∇S_k + w_L L``:
``∇S_k`` the gradient of micro-batch ``k``'s summed loss, ``L`` the gradient present before the
window's first backward. The full batch gives ``w_k = 1 / N`` and ``w_L = 0``; the reported
weights are ``W_k = w_k · N`` (1.0 when right) and ``w_L`` (1.0: the old gradient kept whole).
The *factor* ``c = <a − w_L L, r> / <r, r>`` with ``r = Σ_k ∇S_k / N`` is the one number that
scales the reference best (1.0 when right).

**Precision.** Rounding makes ``a`` differ from ``Σ_k ∇S_k / N`` even in a right run. The band
run (:mod:`fullbatch._probe._reference`) measures one sample of that rounding on one
micro-batch, as a pattern ``d`` per unit of that micro-batch's gradient norm. Each micro-batch
rounds in proportion to its own gradient, so coordinate ``i`` of ``a`` varies by
``var_i = d_i² · Σ_k ‖∇S_k‖² / N² + K · (u · a_i)² / 3`` (the second term: the running sum
rounded to the dtype the gradient is held in, unit roundoff ``u``, once per micro-batch), or by
what the fit leaves there (``res_i²``, corrected for the fitted columns) where that is more.
Four parts make a weight's standard error, added in quadrature:

- the sandwich ``sqrt(Σ_i B_ki² var_i)`` of the least-squares solution ``w = B a`` (``B`` the
  pseudo-inverse): rounding independent from coordinate to coordinate, averaged by the fit;
- the weights' response ``B δ`` to the measured sample itself: rounding coherent across
  coordinates (a few hundred rounded logit gradients feed every weight of a layer);
- the micro-batch's own rounding, the band micro-batch's relative ``‖d‖`` scaled by
  ``sqrt(n_band / n_k)`` (a smaller micro-batch averages fewer rounding errors);
- the fit's own float64 arithmetic: ``ARITH_ULPS`` units of float64 times the columns'
  condition number (added, relative).

The factor's error is the same without the third part (``sqrt(Σ_i r_i² var_i) / <r, r>`` and
``<δ, r> / <r, r>``). How well they hold on right runs is measured by
``benchmarks/probe_judgement.py``. These are the precisions the judge
(:mod:`fullbatch._probe._judge`) holds each weight to.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["ARITH_ULPS", "Fit", "fit"]

#: The fit's own float64 arithmetic, in units of float64 per unit of condition number.
ARITH_ULPS = 16
_EPS64 = float(torch.finfo(torch.float64).eps)


@dataclass(frozen=True)
class Fit:
    """What the fit found, in the units the report prints.

    Attributes:
        weights: ``W_k = w_k · N`` per micro-batch (NaN: no gradient in the sampled
            coordinates).
        stderr: each weight's standard error (see the module docstring; NaN with the weight).
        leftover: ``w_L`` (0.0 without a leftover gradient); ``leftover_stderr`` its error.
        factor: ``c``, the applied gradient's best uniform factor on the reference;
            ``factor_stderr`` its error.
        unexplained: ``‖a − fit‖ / ‖a‖``: what no combination of the window's micro-batches
            explains; ``noise``: what rounding alone would leave there (``sqrt(Σ var_i) / ‖a‖``).
    """

    weights: tuple[float, ...]
    stderr: tuple[float, ...] = ()
    leftover: float = 0.0
    leftover_stderr: float = 0.0
    factor: float = math.nan
    factor_stderr: float = math.nan
    unexplained: float = 0.0
    noise: float = 0.0


def fit(
    samples: torch.Tensor,
    leftover: torch.Tensor | None,
    applied: torch.Tensor,
    count: float,
    *,
    delta: torch.Tensor | None = None,
    unit: float = 0.0,
    counts: tuple[float, ...] = (),
    band_count: float = 0.0,
) -> Fit:
    """Least squares of ``applied`` on the rows of ``samples`` (and ``leftover``), float64,
    with the precision the band's rounding pattern ``delta`` (per unit of gradient norm) and
    the applied gradient's unit roundoff ``unit`` allow; ``counts`` (each micro-batch's items)
    and ``band_count`` (the band micro-batch's) scale the band's relative rounding to each
    micro-batch.

    >>> g = torch.tensor([[1.0, 0.0, 1.0], [0.0, 2.0, 1.0]], dtype=torch.float64)
    >>> f = fit(g, None, (g[0] + 2 * g[1]) / 4, 4.0)
    >>> [round(w, 6) for w in f.weights], f.leftover, round(f.unexplained, 6)
    ([1.0, 2.0], 0.0, 0.0)
    >>> all(e < 1e-13 for e in f.stderr)  # no rounding sample: the fit's arithmetic alone
    True
    """
    k = samples.shape[0]
    columns = [samples[i].double() for i in range(k)]
    has_leftover = leftover is not None and bool(leftover.abs().sum() > 0)
    if has_leftover:
        assert leftover is not None
        columns.append(leftover.double())
    a = applied.double()
    norms = [float(c.norm()) for c in columns]
    finite = bool(torch.isfinite(a).all()) and all(math.isfinite(n) for n in norms)
    live = [i for i, n in enumerate(norms) if n > 0] if finite else []
    solved = [math.nan] * len(columns)
    errors = [math.nan] * len(columns)
    fitted = torch.zeros_like(a) if finite else torch.full_like(a, math.nan)
    d = torch.zeros_like(a) if delta is None else delta.double()
    sizes = float((samples.double() ** 2).sum())  # Σ_k ‖∇S_k‖², sampled
    var = (d**2 * sizes / count**2 if count > 0 else d * 0) + k * (unit * a) ** 2 / 3
    expected = math.sqrt(float(var.sum()))  # what rounding alone leaves, by the band's sample
    sample = d * math.sqrt(sizes) / count if count > 0 else d  # δ, scaled to the window
    arith = ARITH_ULPS * _EPS64
    if live:
        matrix = torch.stack([columns[i] / norms[i] for i in live], dim=1)
        pinv = torch.linalg.pinv(matrix)  # [live, m]
        arith *= float(torch.linalg.cond(matrix)) if len(live) > 1 else 1.0
        solution = pinv @ a
        left = a - matrix @ solution
        dof = max(a.numel() - len(live), 1)
        var = torch.maximum(var, left**2 * (a.numel() / dof))  # the run's own noise, if more
        spread = (pinv**2) @ var
        response = pinv @ sample  # the weights' answer to δ: coherent rounding
        rho = float(d.norm())  # the band micro-batch's relative rounding
        for j, i in enumerate(live):
            times = count if i < k else 1.0  # micro-batch weights are reported times N
            solved[i] = float(solution[j]) / norms[i]
            fitted += solved[i] * columns[i]
            spread_j = math.hypot(math.sqrt(float(spread[j])), float(response[j]))
            errors[i] = (spread_j / norms[i] + arith * abs(solved[i])) * times
            if i < k and i < len(counts) and counts[i] > 0 and band_count > 0:
                own = rho * math.sqrt(band_count / counts[i]) * abs(solved[i]) * count
                errors[i] = math.hypot(errors[i], own)
    weights = tuple(w * count for w in solved[:k])
    w_leftover = solved[k] if has_leftover else 0.0
    ref = samples.double().sum(0) / count if count > 0 else torch.zeros_like(a)
    ref_sq = float(ref @ ref)
    factor, factor_error = math.nan, math.nan
    if ref_sq > 0 and finite:
        rest = a - w_leftover * columns[k] if has_leftover and math.isfinite(w_leftover) else a
        factor = float(rest @ ref) / ref_sq
        coherent = float(sample @ ref) / ref_sq
        spread_c = math.hypot(math.sqrt(float(ref**2 @ var)) / ref_sq, coherent)
        factor_error = spread_c + arith * abs(factor)
    residual = a - fitted
    a_norm = float(a.norm())
    return Fit(
        weights=weights,
        stderr=tuple(errors[:k]),
        leftover=w_leftover,
        leftover_stderr=errors[k] if has_leftover else 0.0,
        factor=factor,
        factor_stderr=factor_error,
        unexplained=float(residual.norm()) / a_norm if a_norm > 0 else 0.0,
        noise=expected / a_norm if a_norm > 0 else 0.0,
    )

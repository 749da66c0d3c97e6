"""``fullbatch probe --plot PATH``: the report's evidence as a picture.

Top row, one panel per probed window: each micro-batch's weight in the applied gradient (1.0
when right) with its measured precision as a band (``± Z·σ``, ``Z`` = 6, the judge's rule
before the dtype's unit roundoff is added), ranks told apart by colour. Bottom: each window's
error against its tolerance (log scale). Matplotlib is an optional extra (``pip install
'fullbatch[demo]'``); :func:`check_matplotlib` says so before anything runs.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["Z", "check_matplotlib", "plot_report"]

#: The judge's number of standard errors a weight may be off (``fullbatch._probe._judge``).
Z = 6.0
_MAX_PANELS = 6


def check_matplotlib() -> str | None:
    """Why ``--plot`` cannot draw here (no matplotlib), or None."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return (
            "--plot needs matplotlib, which is not installed; pip install 'fullbatch[demo]' "
            "(or pip install matplotlib), or leave --plot out"
        )
    return None


def _finite(values: Any) -> list[float]:
    return [v if v is not None and math.isfinite(v) else math.nan for v in values]


def plot_report(report: Any, path: str) -> None:
    """Draw ``report`` (a :class:`~fullbatch._probe._report.ProbeReport`) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    windows = list(report.windows)[:_MAX_PANELS]
    panels = max(1, len(windows))
    fig = plt.figure(figsize=(3.2 * panels + 0.8, 6.0), layout="constrained")
    grid = fig.add_gridspec(2, panels, height_ratios=(3, 2))
    verdict = str(report).splitlines()[0].removeprefix("fullbatch probe: ")
    fig.suptitle(f"fullbatch probe: {verdict}", fontsize=10)
    for i, check in enumerate(windows):
        ax = fig.add_subplot(grid[0, i])
        weights, sigma = _finite(check.weights), _finite(check.precision)
        sigma += [math.nan] * (len(weights) - len(sigma))
        ranks = [r for r, n in enumerate(check.ranks) for _ in range(n)]
        if len(ranks) != len(weights):  # no weight per micro-batch (a coupled objective)
            ranks = [0] * len(weights)
        x = list(range(1, len(weights) + 1))
        low = [1 - Z * s if math.isfinite(s) else math.nan for s in sigma]
        high = [1 + Z * s if math.isfinite(s) else math.nan for s in sigma]
        ax.fill_between(x, low, high, color="0.85", step="mid", label=f"1 ± {Z:g}σ (precision)")
        ax.axhline(1.0, color="0.4", linewidth=0.8)
        for rank in sorted(set(ranks)):
            mine = [j for j, r in enumerate(ranks) if r == rank]
            ax.errorbar(
                [x[j] for j in mine], [weights[j] for j in mine],
                yerr=[Z * sigma[j] if math.isfinite(sigma[j]) else 0.0 for j in mine],
                fmt="o", markersize=4, capsize=2,
                label=f"rank {rank}" if len(set(ranks)) > 1 else "weight",
            )  # fmt: skip
        if not weights and math.isfinite(check.factor):  # one term: the factor alone
            spread = check.factor_precision if math.isfinite(check.factor_precision) else 0.0
            ax.errorbar([1], [check.factor], yerr=[Z * spread], fmt="s", markersize=4,
                        capsize=2, label="factor on the whole window")  # fmt: skip
        widest = max((Z * s for s in sigma if math.isfinite(s)), default=math.nan)
        if math.isfinite(widest):  # often too narrow to see: said in numbers too
            ax.text(0.02, 0.02, f"band: 1 ± {widest:.1g} at most", transform=ax.transAxes,
                    fontsize=7, color="0.3")  # fmt: skip
        ax.set_title(f"window {check.step}: {'right' if check.ok else check.pattern}", fontsize=9)
        ax.set_xlabel("micro-batch")
        if i == 0:
            ax.set_ylabel("weight / correct weight")
            ax.legend(fontsize=7, loc="best")
        ax.set_xticks(x if len(x) <= 16 else x[:: max(1, len(x) // 8)])
    ax = fig.add_subplot(grid[1, :])
    steps = [w.step for w in windows]
    ax.semilogy(steps, _finite([w.error for w in windows]), "o-", label="error")
    ax.semilogy(steps, _finite([w.tolerance for w in windows]), "s--", label="tolerance")
    ax.semilogy(steps, _finite([w.band for w in windows]), ":", color="0.5", label="band")
    ax.set_xlabel("window")
    ax.set_ylabel("‖applied − reference‖ / ‖reference‖")
    ax.set_xticks(steps or [1])
    ax.legend(fontsize=7, loc="best")
    fig.savefig(path, dpi=110)
    plt.close(fig)

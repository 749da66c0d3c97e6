"""``loss.png``: the demo's figure.

The headline panel plots each arm's loss minus the full batch's on the same batch: naive
accumulation moves off zero, differently for each micro-batch size, while fullbatch stays on
it, as close as the full batch with its rows permuted (rounding alone). Beside it, the same gap
as an absolute value on a log scale, where fullbatch's 1e-7 is visible next to the rounding
band instead of hidden under the zero line (the training losses themselves overlap at any
scale, so the full batch's start and end loss are a note). The lower panels: the
shadow-gradient error and the parameter distance to the full batch (log scales, since they span
decades), and the gap between the loss each recipe logs and the true one. Only the
object-oriented Matplotlib API is used: no pyplot, no global state.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fullbatch._demo._experiment import Record

__all__ = ["plot"]

_FULL = "#222222"
_ROUNDING = "#8c8c8c"
_LIMIT = "#b22222"


def _series(records: Sequence[Record], arm: str, m: int | None, field: str) -> tuple[list, list]:
    rows = [r for r in records if r.arm == arm and (m is None or r.micro_batch_size == m)]
    return [r.step for r in rows], [getattr(r, field) for r in rows]


def _rolling_mean(values: Sequence[float], width: int) -> list[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= width:
            total -= values[i - width]
        out.append(total / min(i + 1, width))
    return out


def _arm_styles(micro_batch_sizes: Sequence[int]) -> list[tuple[str, int, dict[str, Any]]]:
    from matplotlib import colormaps

    k = len(micro_batch_sizes)
    shades = [0.95 - 0.5 * i / max(k - 1, 1) for i in range(k)]
    dashes = ["-", "--", ":", "-."]
    styles = []
    for name, cmap in (("naive", "Oranges"), ("fullbatch", "Blues")):
        for i, m in enumerate(sorted(micro_batch_sizes)):
            style = {
                "color": colormaps[cmap](shades[i]),
                "lw": 1.4,
                "ls": "-" if name == "naive" else dashes[i % len(dashes)],
                "label": f"{name}, micro-batch {m}",
            }
            styles.append((name, m, style))
    return styles


def _decorate(ax: Any, title: str, ylabel: str, *, log: bool = False, **title_style: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    if log:
        ax.set_yscale("log")
    ax.set_title(title, loc="left", **{"fontsize": 11, **title_style})
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3, which="major")


def _headline(ax: Any, records: Sequence[Record], styles: list, full_at: dict) -> None:
    def delta(arm: str, m: int | None) -> tuple[list, list]:
        xs, ys = _series(records, arm, m, "true_loss")
        return xs, [y - full_at[x] for x, y in zip(xs, ys, strict=True)]

    steps = sorted(full_at)
    width = max(1, len(steps) // 12)
    ax.axhline(0.0, color=_FULL, lw=1.3, label="full batch", zorder=3)
    ax.plot(
        *delta("permuted_rows", None),
        color=_ROUNDING,
        lw=1.0,
        label="full batch, rows permuted (rounding)",
        zorder=4,
    )
    worst: dict[str, float] = {"naive": 0.0, "fullbatch": 0.0}
    for name, m, style in styles:
        xs, ys = delta(name, m)
        worst[name] = max([worst[name], *(abs(y) for y in ys)])
        if name == "naive":
            ax.plot(xs, ys, color=style["color"], lw=0.7, alpha=0.35)
            smooth = {**style, "lw": 2.2, "label": f"{style['label']} ({width}-step mean)"}
            ax.plot(xs, _rolling_mean(ys, width), **smooth)
        else:
            ax.plot(xs, ys, **style, zorder=5)
    rounding = max((abs(y) for y in delta("permuted_rows", None)[1]), default=0.0)
    note = (
        f"largest |loss − full-batch loss|\n"
        f"naive:  {worst['naive']:.1e}\n"
        f"fullbatch:  {worst['fullbatch']:.1e}\n"
        f"rows permuted:  {rounding:.1e}"
    )
    ax.text(
        0.995,
        0.97,
        note,
        transform=ax.transAxes,
        ha="right",
        va="top",
        fontsize=9,
        family="monospace",
        bbox={"boxstyle": "round", "fc": "white", "ec": "#cccccc"},
    )
    _decorate(
        ax,
        "Invariance: loss minus the full batch's loss on the same batch",
        "loss − full-batch loss (nats/token)",
        fontsize=12.5,
        fontweight="bold",
    )
    ax.legend(ncol=2, fontsize=8.5, loc="lower left", frameon=True, framealpha=0.85)


def plot(
    records: Sequence[Record],
    micro_batch_sizes: Sequence[int],
    path: Path,
    *,
    subtitle: str,
    tolerance: float,
) -> None:
    """Draw the figure into ``path`` (PNG)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(16, 9.5), layout="constrained")
    grid = fig.add_gridspec(2, 3, height_ratios=(1.2, 1))
    head = fig.add_subplot(grid[0, :2])
    curve = fig.add_subplot(grid[0, 2])
    grads, drift, logs = (fig.add_subplot(grid[1, i]) for i in range(3))
    styles = _arm_styles(micro_batch_sizes)
    steps, full_loss = _series(records, "full_batch", None, "true_loss")
    _headline(head, records, styles, dict(zip(steps, full_loss, strict=True)))

    _gap(curve, records, styles, dict(zip(steps, full_loss, strict=True)))

    _against_rounding(grads, records, styles, "shadow_grad_error")
    grads.axhline(
        tolerance, color=_LIMIT, ls=(0, (1, 2)), lw=1.3, label=f"tolerance {tolerance:.0e}"
    )
    _decorate(
        grads, "Gradient error at the full-batch weights", "‖g − g_full‖ / ‖g_full‖", log=True
    )
    grads.legend(fontsize=7.5, loc="center right", framealpha=0.85)

    _against_rounding(drift, records, styles, "param_distance")
    _decorate(drift, "Distance from the full-batch weights", "‖θ − θ_full‖ / ‖θ_full‖", log=True)

    logs.axhline(0.0, color=_FULL, lw=1.0)
    for name, m, style in styles:
        xs, reported = _series(records, name, m, "reported_loss")
        true = _series(records, name, m, "true_loss")[1]
        logs.plot(xs, [r - t for r, t in zip(reported, true, strict=True)], **{**style, "lw": 1.0})
    _decorate(logs, "Logged loss minus true loss", "reported − true (nats/token)")

    fig.suptitle(
        "fullbatch demo: naive accumulation vs fullbatch vs the full batch",
        x=0.01,
        ha="left",
        fontsize=15,
        fontweight="bold",
    )
    fig.supxlabel(
        "\n".join(textwrap.wrap(subtitle, 230, break_on_hyphens=False)), fontsize=9, color="#444444"
    )
    fig.savefig(path, dpi=110)


def _against_rounding(ax: Any, records: Any, styles: Any, column: str) -> None:
    """Every accumulating arm's ``column``, with the rows-permuted full batch as the band."""
    for name, m, style in styles:
        ax.plot(*_series(records, name, m, column), **style)
    ax.plot(
        *_series(records, "permuted_rows", None, column),
        color=_ROUNDING,
        lw=1.2,
        label="full batch, rows permuted",
    )


def _gap(ax: Any, records: Sequence[Record], styles: list, full_at: dict) -> None:
    """|loss − full-batch loss| per arm, a rolling mean on a log scale (a float32 loss differs
    by whole units in its last place, often 0, so single steps would be dots and gaps), the
    rows-permuted full batch as the rounding band, one unit in the last place of the final
    float32 loss as a line, and the training loss as a note."""
    steps = sorted(full_at)
    width = max(1, len(steps) // 12)

    def gap(arm: str, m: int | None) -> tuple[list, list]:
        xs, ys = _series(records, arm, m, "true_loss")
        return xs, _rolling_mean([abs(y - full_at[x]) for x, y in zip(xs, ys, strict=True)], width)

    for name, m, style in styles:
        ax.plot(*gap(name, m), **{**style, "lw": 1.6})
    handles = ax.plot(*gap("permuted_rows", None), color=_ROUNDING, lw=1.4, label="rows permuted")
    last = full_at[steps[-1]]
    ulp = 2.0 ** (math.floor(math.log2(last)) - 23) if last > 0 else 0.0
    if ulp > 0:
        label = f"float32 step of the final loss ({ulp:.1e})"
        handles.append(ax.axhline(ulp, color=_LIMIT, ls=(0, (1, 2)), lw=1.2, label=label))
    ax.legend(handles=handles, fontsize=8, loc="center left", framealpha=0.85)
    ax.text(
        0.98,
        0.5,
        f"full-batch training loss\n{full_at[steps[0]]:.2f} → {last:.2f} nats/token",
        transform=ax.transAxes,
        ha="right",
        va="center",
        fontsize=9,
        bbox={"boxstyle": "round", "fc": "white", "ec": "#cccccc"},
    )
    ax.set_yscale("log", nonpositive="mask")
    _decorate(
        ax, f"The same gap, {width}-step mean, log scale", "|loss − full-batch loss| (nats/token)"
    )

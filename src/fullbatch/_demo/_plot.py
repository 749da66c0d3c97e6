"""``loss.png``: the demo's figure.

The headline panel plots each arm's loss minus the full batch's on the same batch: naive
accumulation splits by micro-batch size, fullbatch stays inside the band that rounding alone
produces (the full batch with its rows permuted). Below: the training loss for context, the
shadow-gradient error on a log scale, and the gap between the loss each recipe logs and the
true one. Only the object-oriented Matplotlib API is used: no pyplot, no global state.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from fullbatch._demo._experiment import Record

__all__ = ["plot"]

_FULL = "#222222"
_ROUNDING = "#9a9a9a"


def _series(records: Sequence[Record], arm: str, m: int | None, field: str) -> tuple[list, list]:
    rows = [r for r in records if r.arm == arm and (m is None or r.micro_batch_size == m)]
    return [r.step for r in rows], [getattr(r, field) for r in rows]


def _arm_styles(micro_batch_sizes: Sequence[int]) -> list[tuple[str, int, dict]]:
    from matplotlib import colormaps

    k = len(micro_batch_sizes)
    shades = [0.9 - 0.45 * i / max(k - 1, 1) for i in range(k)]
    dashes = ["-", "--", ":", "-."]
    styles = []
    for name, cmap in (("naive", "Oranges"), ("fullbatch", "Blues")):
        for i, m in enumerate(sorted(micro_batch_sizes)):
            style = {
                "color": colormaps[cmap](shades[i]),
                "lw": 1.6 if name == "naive" else 1.4,
                "ls": "-" if name == "naive" else dashes[i % len(dashes)],
                "label": f"{name}, micro-batch {m}",
            }
            styles.append((name, m, style))
    return styles


def plot(
    records: Sequence[Record],
    micro_batch_sizes: Sequence[int],
    path: Path,
    *,
    title: str,
    tolerance: float,
) -> None:
    """Draw the four panels into ``path`` (PNG)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 9.5), layout="constrained")
    grid = fig.add_gridspec(2, 3, height_ratios=(1.25, 1))
    head = fig.add_subplot(grid[0, :])
    curve, grads, logs = (fig.add_subplot(grid[1, i]) for i in range(3))
    styles = _arm_styles(micro_batch_sizes)
    steps, full_loss = _series(records, "full_batch", None, "true_loss")
    full_at = dict(zip(steps, full_loss, strict=True))

    def delta(arm: str, m: int | None) -> tuple[list, list]:
        xs, ys = _series(records, arm, m, "true_loss")
        return xs, [y - full_at[x] for x, y in zip(xs, ys, strict=True)]

    # Headline: loss minus full-batch loss, with the rounding band.
    xs, perm = delta("permuted_rows", None)
    band, widest = [], 0.0
    for value in perm:
        widest = max(widest, abs(value))
        band.append(widest)
    head.fill_between(
        xs,
        [-b for b in band],
        band,
        color=_ROUNDING,
        alpha=0.35,
        lw=0,
        label="rounding band: full batch, rows permuted",
    )
    head.axhline(0.0, color=_FULL, lw=1.2, label="full batch")
    for name, m, style in styles:
        head.plot(*delta(name, m), **style)
    head.set_title(
        "Invariance: loss minus the full batch's loss on the same batch",
        loc="left",
        fontsize=13,
        fontweight="bold",
    )
    head.set_xlabel("optimizer step")
    head.set_ylabel("loss − full-batch loss (nats/token)")
    head.legend(ncol=2, fontsize=9, loc="best", frameon=False)
    head.grid(alpha=0.3)

    # Context: the training loss itself.
    curve.plot(steps, full_loss, color=_FULL, lw=2.2, label="full batch")
    for name, m, style in styles:
        curve.plot(*_series(records, name, m, "true_loss"), **{**style, "lw": 1.0})
    curve.set_title("Training loss (context)", loc="left")
    curve.set_xlabel("optimizer step")
    curve.set_ylabel("true loss (token mean, nats)")
    curve.grid(alpha=0.3)

    # Shadow gradients: every recipe at the full-batch weights.
    for name, m, style in styles:
        grads.plot(*_series(records, name, m, "shadow_grad_error"), **{**style, "lw": 1.1})
    grads.plot(
        *_series(records, "permuted_rows", None, "shadow_grad_error"),
        color=_ROUNDING,
        lw=1.1,
        label="full batch, rows permuted",
    )
    grads.axhline(
        tolerance, color="#b22222", ls=(0, (1, 2)), lw=1.2, label=f"tolerance {tolerance:.0e}"
    )
    grads.set_yscale("log")
    grads.set_title("Gradient error at the full-batch weights", loc="left")
    grads.set_xlabel("optimizer step")
    grads.set_ylabel("‖g − g_full‖ / ‖g_full‖")
    grads.legend(fontsize=7, frameon=False, loc="center right")
    grads.grid(alpha=0.3, which="both")

    # What each recipe logs versus the true loss.
    logs.axhline(0.0, color=_FULL, lw=1.0)
    for name, m, style in styles:
        xs, reported = _series(records, name, m, "reported_loss")
        _, true = _series(records, name, m, "true_loss")
        logs.plot(xs, [r - t for r, t in zip(reported, true, strict=True)], **{**style, "lw": 1.1})
    logs.set_title("Logged loss minus true loss", loc="left")
    logs.set_xlabel("optimizer step")
    logs.set_ylabel("reported − true (nats/token)")
    logs.grid(alpha=0.3)

    fig.suptitle(title, fontsize=11, x=0.01, ha="left")
    fig.savefig(path, dpi=110)

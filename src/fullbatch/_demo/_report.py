"""What the demo writes: the per-step table, ``metrics.csv`` and the closing verdict."""

from __future__ import annotations

import csv
import dataclasses
import math
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from fullbatch._demo._experiment import Record

__all__ = ["Verdict", "judge", "table_header", "table_row", "verdict_text", "write_csv"]

_COL = 8  # width of one numeric table column


def write_csv(records: Sequence[Record], path: Path) -> None:
    """One row per step and arm, floats at full precision."""
    names = [f.name for f in dataclasses.fields(Record)]
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(names)
        for record in records:
            writer.writerow([getattr(record, name) for name in names])


_SEP = " | "


def _titles(micro_batch_sizes: Sequence[int]) -> list[tuple[str, list[str]]]:
    sizes = [f"m={m}" for m in micro_batch_sizes]
    return [
        ("", ["step", "loss"]),
        ("naive: gradient error", sizes),
        ("fullbatch: gradient error", sizes),
        ("rows permuted", ["grad", "drift"]),
    ]


def _join(groups: Sequence[str], titles: Sequence[tuple[str, list[str]]]) -> str:
    widths = [max(_COL * len(names), len(title)) for title, names in titles]
    return _SEP.join(f"{g:>{w}}" for g, w in zip(groups, widths, strict=True))


def table_header(micro_batch_sizes: Sequence[int]) -> str:
    """Two header lines for :func:`table_row`."""
    titles = _titles(micro_batch_sizes)
    widths = [max(_COL * len(names), len(title)) for title, names in titles]
    top = _SEP.join(f"{title:^{w}}" for (title, _), w in zip(titles, widths, strict=True))
    names = ["".join(f"{n:>{_COL}}" for n in group) for _, group in titles]
    return f"{top.rstrip()}\n{_join(names, titles)}"


def table_row(records: Sequence[Record], micro_batch_sizes: Sequence[int]) -> str:
    """One step: the full-batch loss, every recipe's shadow-gradient error, the rounding drift."""
    by_arm = {(r.arm, r.micro_batch_size): r for r in records}
    full = next(r for r in records if r.arm == "full_batch")
    permuted = next(r for r in records if r.arm == "permuted_rows")
    groups = [f"{full.step:>{_COL}}{full.true_loss:>{_COL}.4f}"]
    for arm in ("naive", "fullbatch"):
        errors = (by_arm[arm, m].shadow_grad_error for m in micro_batch_sizes)
        groups.append("".join(f"{e:>{_COL}.1e}" for e in errors))
    groups.append(f"{permuted.shadow_grad_error:>{_COL}.1e}{permuted.param_distance:>{_COL}.1e}")
    return _join(groups, _titles(micro_batch_sizes))


@dataclass(frozen=True)
class Verdict:
    """The numbers the demo's conclusion rests on, all computed from the records.

    Attributes:
        tolerance: the largest shadow-gradient error that counts as exact.
        fullbatch_error: micro-batch size -> largest shadow-gradient error over all steps.
        naive_error: the same for naive accumulation.
        rounding_error: largest shadow-gradient error of the rows-permuted full batch.
        naive_loss_gap: largest ``|true loss − full-batch loss|`` of any naive arm.
        fullbatch_loss_gap: the same for fullbatch.
        rounding_loss_gap: the same for the rows-permuted full batch.
        naive_log_gap: largest ``|reported − true loss|`` of any naive arm.
        naive_distance: final relative parameter distance to the full batch, largest naive arm.
        fullbatch_distance: the same, largest fullbatch arm.
        rounding_distance: the same for the rows-permuted full batch.
        steps: how many steps were run.
    """

    tolerance: float
    fullbatch_error: dict[int, float]
    naive_error: dict[int, float]
    rounding_error: float
    naive_loss_gap: float
    fullbatch_loss_gap: float
    rounding_loss_gap: float
    naive_log_gap: float
    naive_distance: float
    fullbatch_distance: float
    rounding_distance: float
    steps: int

    @property
    def fullbatch_exact(self) -> bool:
        """Every fullbatch shadow-gradient error is below the tolerance (NaN is not)."""
        return all(e < self.tolerance for e in self.fullbatch_error.values())

    @property
    def naive_shown_wrong(self) -> bool:
        """Every naive arm exceeded the tolerance at some step."""
        return all(e > self.tolerance for e in self.naive_error.values())

    @property
    def exit_code(self) -> int:
        """0 when fullbatch is exact and naive is visibly not; 1 otherwise."""
        return 0 if self.fullbatch_exact and self.naive_shown_wrong else 1


def _worst(records: Sequence[Record], arm: str, value: str) -> dict[int, float]:
    worst: dict[int, float] = {}
    for r in records:
        if r.arm == arm:
            v = getattr(r, value)
            # max() would hide a NaN; keep it, since a NaN error is a failure.
            old = worst.get(r.micro_batch_size, -math.inf)
            worst[r.micro_batch_size] = v if math.isnan(v) or math.isnan(old) else max(old, v)
    return worst


def judge(records: Sequence[Record], tolerance: float) -> Verdict:
    """Summarize the records into the verdict's numbers."""
    full = {r.step: r.true_loss for r in records if r.arm == "full_batch"}
    last = max(full)

    def gap(arm: str) -> float:
        return max(abs(r.true_loss - full[r.step]) for r in records if r.arm == arm)

    def final(arm: str) -> float:
        return max(r.param_distance for r in records if r.arm == arm and r.step == last)

    return Verdict(
        tolerance=tolerance,
        fullbatch_error=_worst(records, "fullbatch", "shadow_grad_error"),
        naive_error=_worst(records, "naive", "shadow_grad_error"),
        rounding_error=max(_worst(records, "permuted_rows", "shadow_grad_error").values()),
        naive_loss_gap=gap("naive"),
        fullbatch_loss_gap=gap("fullbatch"),
        rounding_loss_gap=gap("permuted_rows"),
        naive_log_gap=max(abs(r.reported_loss - r.true_loss) for r in records if r.arm == "naive"),
        naive_distance=final("naive"),
        fullbatch_distance=final("fullbatch"),
        rounding_distance=final("permuted_rows"),
        steps=last,
    )


def _per_size(errors: dict[int, float]) -> str:
    return ", ".join(f"m={m}: {e:.1e}" for m, e in sorted(errors.items()))


def _max(values: Iterable[float]) -> float:
    values = list(values)
    return math.nan if any(math.isnan(v) for v in values) else max(values)


def _times(ratio: float) -> str:
    if not math.isfinite(ratio) or ratio <= 0:
        return "incomparably"
    return f"about 10^{round(math.log10(ratio))} times"


def verdict_text(verdict: Verdict, context: str) -> str:
    """The closing paragraph: context, the numbers (wrapped to 92 columns), the outcome."""
    v = verdict
    fb_max, naive_max = _max(v.fullbatch_error.values()), _max(v.naive_error.values())
    body = (
        f"Gradients, all taken at the full-batch weights, over {v.steps} steps: fullbatch "
        f"differs from the full batch by at most {fb_max:.1e} relative "
        f"({_per_size(v.fullbatch_error)}), as much as the full batch with its rows in another "
        f"order ({v.rounding_error:.1e}): rounding. Naive loss/K accumulation is off by up to "
        f"{naive_max:.1e} ({_per_size(v.naive_error)}), {_times(naive_max / fb_max)} more, "
        f"and the loss it logs is off by up to {v.naive_log_gap:.3f} nats. Trajectories: the "
        f"largest gap to the full batch's loss is {v.naive_loss_gap:.1e} for naive, "
        f"{v.fullbatch_loss_gap:.1e} for fullbatch and {v.rounding_loss_gap:.1e} for the "
        f"rows-permuted full batch; after the last step the weights are {v.naive_distance:.1e} "
        f"(naive), {v.fullbatch_distance:.1e} (fullbatch) and {v.rounding_distance:.1e} (rows "
        "permuted) away from the full batch's, relative. Training amplifies rounding, so the "
        "rows-permuted run is the band to judge trajectories by."
    )
    if v.exit_code == 0:
        outcome = (
            f"PASS: fullbatch's shadow-gradient error stayed below {v.tolerance:.0e} at every "
            "step; every naive micro-batch size exceeded it."
        )
    elif not v.fullbatch_exact:
        outcome = (
            f"FAIL: fullbatch's shadow-gradient error reached {fb_max:.1e}, above "
            f"{v.tolerance:.0e}; please report this with the command line."
        )
    else:
        outcome = (
            f"INCONCLUSIVE: a naive micro-batch size stayed below {v.tolerance:.0e}, so this "
            "data did not show the problem (did every micro-batch hold as many tokens?)."
        )
    lines = [context]
    for paragraph in (body, outcome):
        lines += textwrap.wrap(paragraph, 92, break_on_hyphens=False)
    return "\n".join(lines)

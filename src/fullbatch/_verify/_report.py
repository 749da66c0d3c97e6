"""The result of :func:`fullbatch.verify`: plain numbers, a verdict and a readable report.

Error measures (all relative to the plain full-batch reference, computed in float64):

- **grad error**: the worst tensor's ``max|Δ| / max|ref|``. A per-tensor measure, so a wrong
  small tensor (a bias, a norm weight) cannot hide behind large embedding gradients. The
  denominator has a floor tied to the whole gradient: its RMS entry
  (``‖ref‖ / sqrt(numel)``), so a tensor whose gradient is ~0 by construction (BERT's
  attention key bias, a bias before BatchNorm) is not judged relative to its own rounding
  noise; a 100% error on a tensor 100 times below that floor still reads 1e-2.
- **global**: ``‖Δ‖ / ‖ref‖`` over all gradients together, the usual single number.
- **loss** and **grad norm**: ``|a - b| / |b|``.

``passed`` needs all four fullbatch errors within the tolerance, an additive ``loss_fn`` and no
randomness left that changes gradients beyond the tolerance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["AdditivityCheck", "GradientComparison", "VerifyReport"]


def _fmt(value: float) -> str:
    if math.isnan(value):
        return "nan"
    if value == 0:
        return "0"
    return f"{value:.1e}"


def _num(value: float) -> str:
    return "nan" if math.isnan(value) else f"{value:.6g}"


@dataclass(frozen=True)
class GradientComparison:
    """One recipe's gradient, loss and grad norm against the full-batch reference.

    Attributes:
        recipe: ``"fullbatch"`` or ``"naive (loss / K)"``.
        max_rel_error: worst tensor's ``max|Δ| / max|ref|``.
        worst_tensor: name of that tensor (``None`` when there was nothing to compare).
        global_rel_error: ``‖Δ‖ / ‖ref‖`` over all gradients.
        loss: the recipe's reported loss.
        loss_rel_error: ``|loss - ref| / |ref|``.
        grad_norm: the recipe's gradient norm.
        grad_norm_rel_error: ``|norm - ref| / ref``.
    """

    recipe: str
    max_rel_error: float
    worst_tensor: str | None
    global_rel_error: float
    loss: float
    loss_rel_error: float
    grad_norm: float
    grad_norm_rel_error: float

    @property
    def worst_error(self) -> float:
        """The largest of the four errors (NaN if any is NaN)."""
        errors = (
            self.max_rel_error,
            self.global_rel_error,
            self.loss_rel_error,
            self.grad_norm_rel_error,
        )
        return math.nan if any(math.isnan(e) for e in errors) else max(errors)


@dataclass(frozen=True)
class AdditivityCheck:
    """``loss_fn`` on the whole batch against the sum over its two halves (rows split in two).

    Attributes:
        whole: ``(loss_sum, count)`` of the whole batch.
        halves: ``(loss_sum, count)`` of the first and of the second half.
        sum_rel_error: ``|S - (S1 + S2)| / max(|S|, |S1| + |S2|)``.
        counts_add: whether ``count == count1 + count2``.
        holds: loss sums and counts both add up within the tolerance.
        causes: what breaks additivity, one sentence each with the fix (empty when it holds).
    """

    whole: tuple[float, float]
    halves: tuple[tuple[float, float], tuple[float, float]]
    sum_rel_error: float
    counts_add: bool
    holds: bool
    causes: tuple[str, ...] = ()

    def summary(self) -> str:
        (s1, n1), (s2, n2) = self.halves
        s, n = self.whole
        verdict = "ok" if self.holds else "FAILED"
        return (
            f"additivity {verdict}: loss sum {_num(s)} vs halves {_num(s1)} + {_num(s2)} "
            f"(rel. error {_fmt(self.sum_rel_error)}); count {n:g} vs {n1:g} + {n2:g}"
        )


@dataclass(frozen=True)
class VerifyReport:
    """What :func:`fullbatch.verify` found; ``str(report)`` is the readable report.

    Attributes:
        passed: fullbatch matched the full batch within ``tolerance`` and nothing (a
            non-additive loss, leftover randomness) makes that match unreliable.
        diagnosis: what is wrong and how to fix it, one sentence per problem (empty when
            passed).
        fullbatch: fullbatch's :class:`GradientComparison`.
        naive: the naive recipe's (per-micro-batch mean ``loss_sum / count``, divided by the
            number of micro-batches), for contrast.
        additivity: the :class:`AdditivityCheck` (``None`` for a one-row batch).
        nondeterminism: grad error between two identical full-batch evaluations.
        rounding_band: the model's own rounding: how far the full batch's gradient moves when
            its loss is normalized after backward (scaled by fullbatch's ``c`` before, divided by
            ``c·N`` after) instead of before, or its rows are permuted
            (the larger of the two, each in ``rounding_bands``): the scale below which
            differences mean nothing (a float64 model that upcasts to float32 inside shows
            about 1e-7 here, bf16 autocast about 1e-2). When it exceeds the dtype's tolerance,
            the tolerance is widened to 4 times the band and a note says so.
        tolerance: relative tolerance applied (by dtype: float64 1e-10, float32 1e-5; or the
            widened one).
        dtype: the dtype the comparison ran in, e.g. ``"float32 + bfloat16 autocast"``.
        rows, micro_batch_size, micro_batches: the batch and how it was split.
        count: items counted over the batch; loss, grad_norm: the full-batch reference's.
        notes: what verify changed for the comparison (dropout, a float32 copy), a widened
            tolerance, and warnings.
        rounding_bands: the rounding band's parts, by how it was measured.
    """

    passed: bool
    diagnosis: list[str]
    fullbatch: GradientComparison
    naive: GradientComparison
    additivity: AdditivityCheck | None
    nondeterminism: float
    rounding_band: float
    tolerance: float
    dtype: str
    rows: int
    micro_batch_size: int
    micro_batches: int
    count: float
    loss: float
    grad_norm: float
    notes: list[str] = field(default_factory=list)
    rounding_bands: dict[str, float] = field(default_factory=dict)

    def __str__(self) -> str:
        verdict = "PASSED" if self.passed else "FAILED"
        lines = [
            f"fullbatch verify: {verdict} ({self.dtype}, tolerance {self.tolerance:.3g} relative)",
            f"batch: {self.rows} rows -> {self.micro_batches} micro-batches of up to "
            f"{self.micro_batch_size} rows; {self.count:g} counted items",
            f"full batch (reference): loss {_num(self.loss)}, grad norm {_num(self.grad_norm)}",
            "",
        ]
        arms = (self.fullbatch, self.naive)
        width = max(len("worst tensor"), *(len(a.worst_tensor or "-") for a in arms)) + 2
        lines.append(
            f"  {'recipe':<18}{'grad error':<12}{'worst tensor':<{width}}"
            f"{'global':<10}{'loss':<10}{'grad norm':<10}"
        )
        for arm in arms:
            lines.append(
                f"  {arm.recipe:<18}{_fmt(arm.max_rel_error):<12}{arm.worst_tensor or '-':<{width}}"
                f"{_fmt(arm.global_rel_error):<10}{_fmt(arm.loss_rel_error):<10}"
                f"{_fmt(arm.grad_norm_rel_error):<10}"
            )
        lines += [
            "  (errors relative to the full batch: grad error = worst tensor's "
            "max|Δ|/max|ref|, global = ‖Δ‖/‖ref‖)",
            "",
        ]
        if self.additivity is not None:
            lines.append(self.additivity.summary())
        if self.nondeterminism == 0:
            lines.append("randomness: none left (two full-batch evaluations are identical)")
        else:
            lines.append(
                f"randomness: two identical full-batch evaluations differ by "
                f"{_fmt(self.nondeterminism)} (grad error)"
            )
        parts = self.rounding_bands or {"loss normalized after backward": self.rounding_band}
        lines.append(
            f"rounding band: {_fmt(self.rounding_band)} (the full-batch gradient moves by "
            + ", ".join(f"{_fmt(v)} with {k}" for k, v in parts.items())
            + ")"
        )
        for title, items in (("notes", self.notes), ("diagnosis", self.diagnosis)):
            if items:
                lines.append(f"{title}:")
                lines += [f"  - {item}" for item in items]
        return "\n".join(line.rstrip() for line in lines)


# Reprs and pickles say fullbatch.VerifyReport, wherever the class is defined; doctest still
# finds its examples here.
VerifyReport.__module__ = "fullbatch"
__test__ = {"VerifyReport": VerifyReport}

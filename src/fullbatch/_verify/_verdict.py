"""From the arms' gradients to a :class:`VerifyReport`: errors, diagnosis, notes, verdict."""

from __future__ import annotations

import math
from dataclasses import dataclass

from fullbatch._verify._arms import ArmResult, compare, grad_norm, relative
from fullbatch._verify._report import AdditivityCheck, GradientComparison, VerifyReport

__all__ = ["Runs", "build_report"]


@dataclass
class Runs:
    """The arms' results, before any verdict."""

    ref: ArmResult
    fullbatch: ArmResult
    naive: ArmResult
    nondeterminism: float  # grad error between two identical full-batch evaluations
    after: float  # grad error of the full batch normalized after backward, as fullbatch does
    permuted: float  # grad error of the full batch with its rows in reverse order

    @property
    def band(self) -> float:
        """The model's own rounding band: the larger of ``after`` and ``permuted``."""
        return max(self.after, self.permuted)


def _comparison(recipe: str, arm: ArmResult, ref: ArmResult, ref_norm: float) -> GradientComparison:
    worst, name, global_error = compare(ref.grads, arm.grads)
    norm = arm.reported_grad_norm if arm.reported_grad_norm is not None else grad_norm(arm.grads)
    if arm.skipped_reason is not None:
        worst = global_error = math.nan
    return GradientComparison(
        recipe=recipe,
        max_rel_error=worst,
        worst_tensor=name,
        global_rel_error=global_error,
        loss=arm.loss,
        loss_rel_error=relative(arm.loss, ref.loss),
        grad_norm=norm,
        grad_norm_rel_error=relative(norm, ref_norm),
    )


def _diagnose(
    runs: Runs, fb_error: GradientComparison, additivity: AdditivityCheck | None, tol: float
) -> list[str]:
    diagnosis: list[str] = []
    deterministic = runs.nondeterminism <= tol
    if runs.fullbatch.skipped_reason is not None:
        diagnosis.append(f"fullbatch skipped the step ({runs.fullbatch.skipped_reason})")
    elif not fb_error.worst_error <= tol:
        where = f" (worst tensor {fb_error.worst_tensor})" if fb_error.worst_tensor else ""
        if not (deterministic and (additivity is None or additivity.holds)):
            why = "expected, see below"
        elif runs.band * 10 >= fb_error.worst_error:
            why = (
                f"the model's own rounding band is {runs.band:.1e} (normalizing after backward "
                "or permuting rows moves the full-batch gradient that much), so this is most "
                "likely rounding inside the model; pass a larger rtol or compare in float64"
            )
        else:
            why = (
                "loss_fn is additive and deterministic, so this is a fullbatch bug; please "
                "report it with this output"
            )
        diagnosis.append(
            f"fullbatch differs from the full batch by {fb_error.worst_error:.2e} > {tol:g}"
            f"{where}: {why}"
        )
    if not deterministic:
        diagnosis.append(
            f"randomness left: two identical full-batch evaluations differ by "
            f"{runs.nondeterminism:.2e} > {tol:g}, so no comparison is reliable; something "
            "random is still active (functional dropout with a fixed p, stochastic depth, "
            "random augmentation in forward or loss_fn); make it deterministic for the check, "
            "e.g. model.eval() when the model has no BatchNorm"
        )
    if additivity is not None and not additivity.holds and deterministic:
        diagnosis += list(additivity.causes)
    return diagnosis


def build_report(
    runs: Runs,
    additivity: AdditivityCheck | None,
    tol: float,
    dtype: str,
    rows: int,
    micro_batch_size: int,
    notes: list[str],
) -> VerifyReport:
    """The verdict: passed when fullbatch is within ``tol`` and nothing makes that unreliable."""
    ref_norm = grad_norm(runs.ref.grads)
    fb_error = _comparison("fullbatch", runs.fullbatch, runs.ref, ref_norm)
    naive_error = _comparison("naive (loss / K)", runs.naive, runs.ref, ref_norm)
    micro_batches = math.ceil(rows / micro_batch_size)
    diagnosis = _diagnose(runs, fb_error, additivity, tol)
    if additivity is None:
        notes.append("one row: the additivity check needs at least 2 rows")
    elif not additivity.holds and runs.nondeterminism > tol:
        notes.append("additivity is not diagnosed while randomness is left")
    if naive_error.worst_error <= tol and tol > runs.band * 10:
        notes.append(
            "the naive recipe is exact here too: every micro-batch counts the same number of "
            "items (vary padding or -100 labels to see it fail)"
        )
    elif naive_error.worst_error <= tol:
        notes.append(
            f"the naive recipe's error {naive_error.worst_error:.1e} is within the tolerance "
            "too: at this precision the comparison cannot tell it from the full batch; compare "
            "in float32 or float64 (or vary the counts per micro-batch more) for a sharper check"
        )
    return VerifyReport(
        passed=not diagnosis,
        diagnosis=diagnosis,
        fullbatch=fb_error,
        naive=naive_error,
        additivity=additivity,
        nondeterminism=runs.nondeterminism,
        rounding_band=runs.band,
        tolerance=tol,
        dtype=dtype,
        rows=rows,
        micro_batch_size=micro_batch_size,
        micro_batches=micro_batches,
        count=runs.ref.count,
        loss=runs.ref.loss,
        grad_norm=ref_norm,
        notes=notes,
        rounding_bands={
            "loss normalized after backward as fullbatch does": runs.after,
            "rows permuted": runs.permuted,
        },
    )

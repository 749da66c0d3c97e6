"""The judge: whether a window is right, which pattern it shows and the sentence that says so.

Nothing else decides ``ok``, the pattern or the diagnosis, so they cannot disagree.

**The rule.** A window is *wrong* when any of these holds:

1. its error exceeds its tolerance: ``error > tolerance``, ``tolerance = BAND_FACTOR · band``
   and at least ``FLOOR_ULPS`` units of the parameters' dtype
   (:mod:`fullbatch._proof._tolerance`, the rule ``fb.verify`` uses);
2. a fitted weight ``W_k``, the uniform factor ``c`` or the leftover weight ``w_L`` is *off*:
   ``|W − 1| > Z · σ + u`` (``|w_L| > Z · σ_L + u``), with ``σ`` its standard error measured on
   this run (:mod:`fullbatch._probe._fit`: the band run's rounding sample, propagated through
   the least squares) and ``u`` the unit roundoff of the least precise dtype the window's
   gradient flows through: the applied gradient's, the parameters', an autocast region's, and
   at least float32's;
3. the ranks' applied gradients differ by more than the tolerance.

Why both. The error test alone lets a dtype floor hide a mistake the run measures precisely:
under bfloat16 parameters the floor is 16 units of 2⁻⁷ (12.5%), above a 3.5% mean of
per-micro-batch means; a float32 gradient scaled by 0.993 under bfloat16 autocast has a 0.8%
error, under a band widened by the autocast's rounding. The weights are measured far more
precisely than the error is bounded (a fit over thousands of coordinates), so a factor that
the run pins to ``± 3·10⁻⁴`` is wrong at ``0.993``.

Why ``u``, and why that dtype. A right engine may round coherently once in any dtype its
gradient flows through: ``loss / N`` in bfloat16 (up to 0.39% on every weight), or, under
bfloat16 autocast, logit gradients that are nearly equal (at initialization) and so round
alike when cast to bfloat16: right autocast windows put ``c`` up to 14 of its errors from 1
(``|c − 1|`` up to 0.0021, ``benchmarks/probe_judgement.py``). Judged with float32's ``u`` (the
gradient's dtype under autocast) they would be false alarms; with bfloat16's they are right,
and ``× 0.993`` (0.7% > 0.39%) is still caught wherever ``σ`` is small. Losses are computed in
float32 at least (autocast, transformers and fullbatch upcast them), hence its floor: a
float64 model whose loss rounds in float32 is right to ``6·10⁻⁸``. ``Z · σ`` and ``u`` add
(rather than the larger of the two) because a right run's deviation is their sum: one
coherent rounding plus the noise of every micro-batch. ``Z = 6``: once ``u`` is taken off,
300 right windows of that benchmark stayed within 0.7 errors (weights) and 0.3 (factors);
before it, factors reached 14.

**The pattern** is named only where it agrees with the rule. Nothing off and the error within
tolerance: ``"right"``. Weights all within precision but the error over: ``"loss differs"``,
whose sentence says the micro-batches are weighted right and how much of the applied gradient
lies outside their span. Something off and that share above what rounding leaves
(``SPAN_FACTOR`` times the noise the fit expects): ``"loss differs"`` too (label smoothing,
another loss, a changed gradient: no combination of the micro-batches, so no accumulation
fix). Otherwise the weights' shape (:mod:`fullbatch._probe._patterns`): uniform (``"partial
window"``, ``"not normalized"``), ``"per-rank count"``, ``"mean of per-micro-batch means"``;
else ``"dropped"`` or ``"counted twice"`` for the off weights; else ``"other"`` with the
largest deviating weights. A factor that is off is never called right, and no sentence
contradicts the weights the report prints.

**Several optimizers.** When several optimizers stepped at a window's end, each one's
parameters are judged by the same rule on their own (their error, their fitted weights and
factor), beside the whole window: a mistake confined to one optimizer's parameters (a gradient
left scaled, a group clipped alone) is wrong even where the whole window's error hides it, and
its sentence names that optimizer and its parameters. When every optimizer shows the same
pattern as the whole window, the whole window's sentence stands alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from fullbatch._probe._fixes import fix
from fullbatch._probe._judge_step import clip_note, step_findings
from fullbatch._probe._measured import Measured
from fullbatch._probe._patterns import SLACK, matching, shapes
from fullbatch._probe._window_stat import with_statistic

__all__ = ["SPAN_FACTOR", "Judgement", "Z", "judge"]

#: A weight is off beyond this many of its standard errors (plus one unit roundoff).
Z = 6.0
#: What the fit leaves unexplained is more than rounding beyond this many times the noise.
SPAN_FACTOR = 4.0


@dataclass(frozen=True)
class Judgement:
    """``ok``, the pattern's name and the sentence (with the fix when wrong); ``parts``: one
    line per optimizer when several stepped together; ``patterns``: every pattern named, the
    first being ``pattern`` (a mean of means with a dropped micro-batch, a clip before
    unscaling on a right accumulation)."""

    ok: bool
    pattern: str
    sentence: str
    parts: tuple[str, ...] = ()
    patterns: tuple[str, ...] = ()


def _margin(error: float, u: float, of: float = 1.0) -> float:
    return Z * (error if math.isfinite(error) else 0.0) + u * abs(of)


def _pm(w: float, e: float) -> str:
    return f"{w:.3g} ± {e:.1g}" if math.isfinite(e) and e > 0 else f"{w:.3g}"


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


def _items(n: float) -> str:
    return f"{n:g} item" + ("" if n == 1 else "s")


def _extremes(m: Measured) -> str:
    finite = [(w, k) for k, w in enumerate(m.fit.weights) if math.isfinite(w)]
    (lo, klo), (hi, khi) = min(finite), max(finite)
    return (
        f"{_where(m, khi)} ({_items(m.counts[khi])}) weighted {hi:.2f}, "
        f"{_where(m, klo)} ({_items(m.counts[klo])}) {lo:.2f}"
    )


def _largest(m: Measured) -> str:
    devs = sorted(
        (
            (abs(w - 1), k, w)
            for k, w in enumerate(m.fit.weights)
            if math.isfinite(w) and abs(w - 1) > _margin(m.fit.stderr[k], m.unit)
        ),
        reverse=True,
    )[:3]
    shown = ", ".join(f"{_where(m, k)} {_pm(w, m.fit.stderr[k])}" for _, k, w in devs)
    return f"largest deviating weights: {shown}" if shown else "no micro-batch weight is off"


def _factor_text(c: float, k: int) -> str:
    if k > 1 and abs(c - k) <= SLACK * k:
        return f"x{c:.3g} (= K: the loss is not divided by the {k} micro-batches)"
    if k > 1 and abs(c * k - 1) <= SLACK:
        return f"x{c:.3g} (= 1/K: divided by the {k} micro-batches once too often)"
    return (
        f"x{c:.3g}: a divisor other than the window's item count, or a loss {c:.3g} times the "
        "declared objective (then declare the loss you train, objective=fn, and this is no "
        "accumulation mistake)"
    )


def _round(x: float) -> bool:
    """Whether ``x`` is a number someone would pick as a max_norm (two significant digits)."""
    return x > 0 and abs(float(f"{x:.2g}") - x) <= 1e-4 * x


def _partial(m: Measured, c: float, k_max: int) -> str | None:
    """The sentence of a window weighted ``k/K`` as if it held ``K`` micro-batches, or None."""
    k = len(m.counts)
    close = SLACK * c + _margin(m.fit.factor_stderr, m.unit, c)
    if k_max > k and abs(c - k / k_max) <= close:
        return (
            f"partial window: this window has {k} micro-batch{'es' * (k > 1)} where others had "
            f"{k_max}, and it is weighted {c:.3g} = {k}/{k_max} of a full-batch step"
        )
    big = round(k / c) if 0 < c < 1 else 0
    if k == 1 and big >= 2 and abs(c - 1 / big) <= close:
        return (
            f"partial window: this window has 1 micro-batch and is weighted {c:.3g} = 1/{big}, "
            f"as if it held {big} (a step after the first micro-batch, e.g. "
            f"batch_idx % {big} == 0, or a short last window)"
        )
    return None


def _uniform(m: Measured, c: float, k_max: int) -> tuple[str, str]:
    partial = _partial(m, c, k_max)
    if partial is not None:
        return "partial window", partial
    text = f"not normalized: every micro-batch weighted {_factor_text(c, max(m.ranks))}"
    if c < 1 and m.no_backward:
        n = m.no_backward
        text += (
            f"; {n} forward{'s' * (n > 1)} of this window reached no backward: a micro-batch "
            "whose backward was skipped still counted in the divisor weighs the others down so"
        )
    if c < 1 and m.clip is None and _round(m.applied_norm):
        text += (
            f"; the applied gradient's norm is {m.applied_norm:.2g}: if that is your max_norm, "
            "a clip the probe did not see (one that is not torch's clip_grad_norm_)"
        )
    return "not normalized", text


def _per_rank(m: Measured, c: float) -> tuple[str, str]:
    start, parts = 0, []
    for rank, n in enumerate(m.ranks):
        finite = [w for w in m.fit.weights[start : start + n] if math.isfinite(w)]
        if finite:
            parts.append(f"rank {rank}'s micro-batches weighted {sum(finite) / len(finite):.2f}")
        start += n
    scaled = "" if abs(c - 1) <= SLACK else f", and not normalized: x{c:.3g}"
    return "per-rank count", (
        "per-rank count: each rank divided its loss by its own item count instead of the "
        f"window's {m.count:g} items over all ranks, so ranks weigh unequally{scaled}: "
        + ", ".join(parts)
    )


def _mean_of_means(m: Measured, c: float) -> tuple[str, str]:
    if abs(c - 1) <= SLACK + _margin(m.fit.factor_stderr, m.unit):
        return "mean of per-micro-batch means", (
            "mean of per-micro-batch means: each micro-batch's loss was averaged over its own "
            "items, so micro-batches weigh by 1/(their item count) instead of alike: "
            + _extremes(m)
        )
    return "mean of per-micro-batch means", (
        f"mean of per-micro-batch means, and not normalized: {_factor_text(c, max(m.ranks))}; "
        + _extremes(m)
    )


def _outliers(m: Measured, off: list[int]) -> tuple[str, str] | None:
    """Off weights all at 0 (dropped) or all at 2 (counted twice), the others right."""
    w, e = m.fit.weights, m.fit.stderr
    names = ", ".join(_where(m, k) for k in off)
    if all(abs(w[k]) <= Z * e[k] + SLACK for k in off):
        return "dropped", f"dropped: {names} ran but contributed nothing (weight 0.00)"
    if all(abs(w[k] - 2) <= Z * e[k] + 2 * (SLACK + m.unit) for k in off):
        return "counted twice", f"counted twice: {names} weighted 2.00 (two backward passes)"
    return None


_BOTH = "dropped, and a mean of per-micro-batch means"


def _dropped_and_shaped(m: Measured, off: list[int]) -> tuple[str, str] | None:
    """Some micro-batches at weight 0 and the others a mean of per-micro-batch means (an engine
    that keeps one backward's gradient, under a loop that averages per micro-batch)."""
    w, e = m.fit.weights, m.fit.stderr
    zeros = [k for k in off if abs(w[k]) <= Z * e[k] + SLACK]
    rest = [k for k, x in enumerate(w) if k not in zeros and math.isfinite(x)]
    if not zeros or len(rest) < 2:
        return None
    shape = shapes(m.counts, m.ranks, m.count)["mean of per-micro-batch means"]
    c = matching([w[k] for k in rest], [e[k] for k in rest], [shape[k] for k in rest], Z, m.unit)
    uniform = matching([w[k] for k in rest], [e[k] for k in rest], [1.0] * len(rest), Z, m.unit)
    if c is None or uniform is not None:
        return None
    names = ", ".join(_where(m, k) for k in zeros)
    lo, hi = min(rest, key=lambda k: w[k]), max(rest, key=lambda k: w[k])
    return "dropped", (
        f"{_BOTH}: {names} ran but contributed nothing (weight 0.00), and the others were "
        f"each averaged over their own items, so they weigh by 1/(their item count): "
        f"{_where(m, hi)} ({_items(m.counts[hi])}) weighted {w[hi]:.2f}, {_where(m, lo)} "
        f"({_items(m.counts[lo])}) {w[lo]:.2f}"
    )


def _named(m: Measured, off: list[int], k_max: int) -> tuple[str, str]:
    """The pattern of a window whose weights or factor are off (see the module docstring)."""
    f = m.fit
    if f.unexplained > SPAN_FACTOR * f.noise + m.unit:
        return "loss differs", (
            f"the loss differs from the declared objective ({m.objective}): "
            f"{f.unexplained:.1%} of the applied gradient is no combination of this window's "
            f"micro-batches (rounding leaves {f.noise:.1g}), best uniform factor "
            f"x{_pm(f.factor, f.factor_stderr)}: label smoothing, another loss (Huber, focal), a "
            "loss term or a gradient changed before step(); not an accumulation mistake"
        )
    for name, shape in shapes(m.counts, m.ranks, m.count).items():
        c = matching(f.weights, f.stderr, shape, Z, m.unit)
        if c is None:
            continue
        if name == "uniform":
            if abs(c - 1) <= _margin(f.factor_stderr, m.unit):
                continue  # alike at 1: the uniform shape explains nothing that is off
            return _uniform(m, c, k_max)
        if name == "per-rank count":
            return _per_rank(m, c)
        return _mean_of_means(m, c)
    named = (_outliers(m, off) or _dropped_and_shaped(m, off)) if off else None
    if named is not None:
        return named
    if not off:
        return "not normalized", (
            f"not normalized: the applied gradient is the reference times "
            f"{_pm(f.factor, f.factor_stderr)}, beyond its precision, though no single weight "
            "is measured that precisely"
        )
    return "other", f"error {m.error:.2g}; {_largest(m)}"


def judge(m: Measured, k_max: int) -> Judgement:
    """Judge window ``m``; ``k_max``: the most micro-batches of any window checked: its
    accumulation (below), then the rest of the step (:mod:`fullbatch._probe._judge_step`).

    Doctested in ``tests/probe``: every pattern against a plain full-batch reference.
    """
    return _with_step(_accumulation(m, k_max), m)


def _with_step(j: Judgement, m: Measured) -> Judgement:
    """The accumulation's judgement, and what the clips did to the step (wrong, or a note)."""
    j = replace(j, patterns=j.patterns or (j.pattern,))
    if m.problem is not None:
        return j
    found = step_findings(m)
    if not found:
        note = clip_note(m)
        return j if note is None else replace(j, sentence=f"{j.sentence} ({note})")
    text = (
        "; ".join(t for _, t in found)
        + ". "
        + " ".join(fix(p, m.engine, m.refused) for p, _ in found)
    )
    names = tuple(p for p, _ in found)
    if j.ok:
        return Judgement(False, names[0], text, j.parts, names)
    return replace(j, sentence=f"{j.sentence} Also {text}", ok=False,
                   patterns=(*j.patterns, *names))  # fmt: skip


def _accumulation(m: Measured, k_max: int) -> Judgement:
    """The rule of the module docstring: the accumulation alone."""
    whole = _judge(m, k_max)
    if len(m.parts) < 2 or m.problem is not None:
        return _fixed(whole, m)
    each = [
        (part, _judge(replace(m, error=part.error, tolerance=part.tolerance, fit=part.fit,
                              applied_norm=part.applied_norm, parts=()), k_max))
        for part in m.parts
    ]  # fmt: skip
    lines = tuple(
        f"{part.label}: "
        + ("right" if j.ok else f"WRONG, {j.pattern}")
        + f" (error {part.error:.1e}, factor {part.fit.factor:.4g})"
        for part, j in each
    )
    wrong = [(part, j) for part, j in each if not j.ok]
    alike = len(wrong) == len(each) and {j.pattern for _, j in wrong} == {whole.pattern}
    if not wrong or alike:
        return replace(_fixed(whole, m), parts=lines)
    text = "; ".join(f"{part.label}: {j.sentence}" for part, j in wrong)
    right = [part.label.split(" (")[0] for part, j in each if j.ok]
    if right:
        text += f"; the parameters of {' and '.join(right)} are right"
    pattern = wrong[0][1].pattern
    return Judgement(False, pattern, f"{text}. {fix(pattern, m.engine, m.refused)}", lines)


def _fixed(j: Judgement, m: Measured) -> Judgement:
    """The judgement with the fix appended when wrong (its sentence said what, not how)."""
    if j.ok or m.problem is not None:
        return j
    return replace(j, sentence=f"{j.sentence}. {fix(j.pattern, m.engine, m.refused)}")


def _in_unit(m: Measured) -> tuple[str, float] | None:
    """The other unit of the declared objective (``Measured.units``) in which the applied
    gradient is right: every weight and the factor at that unit's factor within their
    precision, nothing outside the micro-batches' span; or None."""
    f = m.fit
    if f.unexplained > SPAN_FACTOR * f.noise + m.unit:
        return None
    for name, factor in m.units:
        c = matching(f.weights, f.stderr, [1.0] * len(f.weights), Z, m.unit)
        close = SLACK * factor + _margin(f.factor_stderr, m.unit, factor)
        if c is not None and abs(c - factor) <= close and abs(f.factor - factor) <= close:
            return name, f.factor
    return None


def _judge(m: Measured, k_max: int) -> Judgement:
    """The rule of the module docstring on one set of parameters; the sentence without fix."""
    if m.problem is not None:
        return Judgement(False, m.problem_pattern, m.problem)
    f = m.fit
    off = [
        k
        for k, w in enumerate(f.weights)
        if math.isfinite(w) and abs(w - 1) > _margin(f.stderr[k], m.unit)
    ]
    factor_off = math.isfinite(f.factor) and abs(f.factor - 1) > _margin(f.factor_stderr, m.unit)
    leftover_off = abs(f.leftover) > _margin(f.leftover_stderr, m.unit)
    error_over = not m.error <= m.tolerance
    differ = m.ranks_differ > m.tolerance
    stat = m.statistic if m.statistic is not None and m.statistic.error > m.tolerance else None
    unit = _in_unit(m) if (off or factor_off) and not (leftover_off or differ) else None
    if unit is not None:
        name, c = unit
        return Judgement(
            True,
            "right",
            f"right: the applied gradient is the full-batch gradient of the declared objective "
            f"({m.objective}) counted in {name}: every micro-batch weighted {c:.4g} of a "
            f"per-row sum alike, so the step is the full batch's in that unit "
            f"({m.engine.name}).",
        )
    if not (off or factor_off or leftover_off or error_over or differ or stat):
        return Judgement(
            True,
            "right",
            f"right: the applied gradient is the full-batch gradient of the declared objective "
            f"({m.objective}) over these {len(m.counts)} micro-batches ({m.engine.name}).",
        )
    if differ:
        pattern = "ranks differ"
        text = (
            f"ranks differ: the gradients about to be applied differ between ranks by "
            f"{m.ranks_differ:.2g} (relative), so the replicas would diverge"
        )
    elif leftover_off:
        pattern = "leftover gradient"
        text = (
            f"leftover gradient: the window started with gradients from before it, kept with "
            f"weight {_pm(f.leftover, f.leftover_stderr)}"
        )
    elif off or factor_off:
        pattern, text = _named(m, off, k_max)
    else:
        spread = max((e for e in f.stderr if math.isfinite(e)), default=0.0)
        pattern, text = (
            "loss differs",
            (
                f"error {m.error:.2g} over the tolerance {m.tolerance:.2g}, yet the micro-batches "
                f"are weighted right (1.00 ± {spread:.1g}): {f.unexplained:.1%} of the applied "
                "gradient is not in their span: another loss term, a gradient changed before "
                "step(), or a loss that differs from the declared objective"
            ),
        )
    named = (pattern, "mean of per-micro-batch means") if text.startswith(_BOTH) else (pattern,)
    if stat is not None:  # a MoE window's load balancing per micro-batch: named with its share
        first, said, every = with_statistic(stat, named, text)
        return Judgement(False, first, said, patterns=every)
    return Judgement(False, pattern, text, patterns=named)

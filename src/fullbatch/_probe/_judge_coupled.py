"""The judge's rule for a window of a declared coupled objective (:mod:`fullbatch._probe._whole`).

The reference is the objective over the whole window, a single term: there is no weight per
micro-batch to fit, so the accumulation is right when the error is within the tolerance (the
whole window's measured band) and the factor ``<a, r> / <r, r>`` within ``Z`` of its precision
(plus the unit roundoff), the rule of :mod:`fullbatch._probe._judge` on the one term; the rest
of the step (a clip, a scaler) is judged there as for every window. Where the accumulation is
wrong, the applied gradient fitted on each micro-batch's own gradient of the objective names
the mistake: inside their span (what rounding leaves), the loss was taken per micro-batch,
``"coupled loss taken per micro-batch"`` (each row met only its own micro-batch's rows:
in-batch negatives from ``n_k`` rows instead of ``N``); the whole window's gradient times a
factor is ``"not normalized"``; anything else ``"loss differs"``.
"""

from __future__ import annotations

import math
from dataclasses import replace

from fullbatch._probe._judge import SPAN_FACTOR, Judgement, Z, judge
from fullbatch._probe._judge_step import clip_note
from fullbatch._probe._measured import Measured

__all__ = ["PER_MICRO_BATCH", "judge_coupled"]

PER_MICRO_BATCH = "coupled loss taken per micro-batch"
_FIX = (
    "Make the window's loss the full batch's with fb.Accumulator's window.run_coupled(encode, "
    "loss) (encode(micro) returns the representations, loss scores the whole window's; "
    "docs/coupled.md)"
)


def _weights(m: Measured) -> str:
    pm = m.per_micro
    assert pm is not None
    pairs = [(w, e) for w, e in zip(pm.weights, pm.stderr, strict=False) if math.isfinite(w)]
    if pairs and all(abs(w - 1) <= Z * e + m.unit for w, e in pairs):
        return "every micro-batch weighted 1.00, its own loss"
    ws = [w for w, _ in pairs]
    return f"micro-batches weighted {min(ws):.2f} to {max(ws):.2f}" if ws else "no weight"


def _per_micro(m: Measured) -> str:
    counts = [n for n in m.counts if n > 0]
    rows = f"{min(counts):g}" if min(counts) == max(counts) else f"{min(counts):g}-{max(counts):g}"
    return (
        f"{PER_MICRO_BATCH}: the declared coupled objective ({m.objective}) was taken over each "
        f"micro-batch's own items: the applied gradient is the sum of the {len(m.counts)} "
        f"micro-batches' own gradients of it ({_weights(m)}), {m.error:.2g} from its gradient "
        f"over the whole window (tolerance {m.tolerance:.2g}), so each item met the {rows} items "
        f"of its micro-batch instead of the window's {m.count:g}. {_FIX}"
    )


def judge_coupled(m: Measured, k_max: int) -> Judgement:
    """Judge window ``m`` of a declared coupled objective (the module docstring's rule)."""
    pm, f = m.per_micro, m.fit
    off = not math.isfinite(f.factor) or abs(f.factor - 1) > Z * f.factor_stderr + m.unit
    if pm is None or m.problem is not None or (m.error <= m.tolerance and not off):
        plain = judge(replace(m, per_micro=None), k_max)  # the one term, the step's findings
        if not plain.ok or m.problem is not None:
            return plain  # the accumulation is right, the rest of the step is not
        note = clip_note(m)
        return Judgement(True, "right", (
            f"right: the applied gradient is the gradient of the declared coupled objective "
            f"({m.objective}) over the whole window, its {len(m.counts)} micro-batches' "
            f"{m.count:g} items as one batch ({m.engine.name})" + (f" ({note})" if note else "")
            + "."
        ), patterns=("right",))  # fmt: skip
    if pm.weights and pm.unexplained <= SPAN_FACTOR * pm.noise + m.unit:
        return Judgement(False, PER_MICRO_BATCH, _per_micro(m), patterns=(PER_MICRO_BATCH,))
    rest = math.sqrt(max(m.error**2 - (f.factor - 1) ** 2, 0.0))
    if off and rest <= m.tolerance:
        return Judgement(False, "not normalized", (
            f"not normalized: the applied gradient is the declared coupled objective's gradient "
            f"over the whole window ({m.objective}) times {f.factor:.4g}: a divisor other than "
            f"the window's {m.count:g} items"
        ), patterns=("not normalized",))  # fmt: skip
    return Judgement(False, "loss differs", (
        f"loss differs: the applied gradient is neither the declared coupled objective's "
        f"gradient over the whole window ({m.objective}: error {m.error:.2g}, tolerance "
        f"{m.tolerance:.2g}, factor {f.factor:.4g}) nor a combination of the micro-batches' own "
        f"({pm.unexplained:.1%} outside their span): another loss, or a gradient changed "
        "before step()"
    ), patterns=("loss differs",))  # fmt: skip

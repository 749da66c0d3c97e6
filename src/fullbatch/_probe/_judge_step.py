"""The judge's rule for the rest of the step: the clips and the clip the trainer was asked for.

The accumulation can be right while the step is not: a clip's coefficient multiplies the whole
update, so the probe compares the coefficient applied with the one the user asked for, on the
gradient being judged (``Measured.clips``, ``Measured.asked``):

- **scaled clip**: a clip whose input norm is not the judged gradient's (``clip_grad_norm_``
  before ``scaler.unscale_``: ``scale`` times it) is wrong when the coefficient it applied is
  not the one the same clip gives on the judged gradient, ``min(1, max_norm / (‖g‖ + 1e-6))``
  (a clip that would not have clipped either way changes nothing);
- **clip differs**: a trainer configured with one clip (``TrainingArguments.max_grad_norm``,
  Lightning's ``gradient_clip_val``) whose engine applied another (DeepSpeed's
  ``gradient_clipping``, or its default when the config leaves it out) is wrong when the two
  coefficients differ on this window; where they agree here (neither clips) the report still
  names both values and where each comes from.

Coefficients agree within :data:`AGREES` (relative): norms summed in float32 in another order
differ by ~1e-6; a scaler's factor is at least 2. Only :mod:`fullbatch._probe._judge` calls
this.
"""

from __future__ import annotations

import math

from fullbatch._probe._measured import ClipMeasured, Measured, StepAsked

__all__ = ["AGREES", "clip_note", "step_findings"]

#: Relative slack between two coefficients (or a clip's input norm and the judged one).
AGREES = 1e-2


def _coef(max_norm: float, norm: float) -> float:
    """The coefficient torch's ``clip_grad_norm_`` applies at ``max_norm`` (0: no clip)."""
    return 1.0 if max_norm <= 0 else min(1.0, max_norm / (norm + 1e-6))


def _times(ratio: float) -> str:
    """``2^16`` for a power of two (a GradScaler's scale), else ``3.1``."""
    if ratio >= 2:
        k = math.log2(ratio)
        if abs(k - round(k)) < 1e-3:
            return f"2^{round(k)}"
    return f"{ratio:.3g}"


def _scaled(c: ClipMeasured) -> str | None:
    if not (c.gradient_norm > 0 and math.isfinite(c.input_norm)):
        return None
    ratio = c.input_norm / c.gradient_norm
    right = _coef(c.max_norm, c.gradient_norm)
    if abs(ratio - 1) <= AGREES or abs(c.coef - right) <= AGREES * right:
        return None
    scaler = " (a GradScaler's scale)" if _times(ratio).startswith("2^") else ""
    return (
        f"scaled clip: the clip's input norm is {_times(ratio)} x the gradient's{scaler}: "
        f"{c.source} saw norm {c.input_norm:.3g} where the gradient the optimizer applies has "
        f"norm {c.gradient_norm:.3g} before the clip, so it multiplied the update by "
        f"{c.coef:.3g} instead of {right:.3g}: every update is {c.coef / right:.3g} of the one "
        "asked for (the accumulation itself is right)"
    )


def _differs(a: StepAsked) -> str | None:
    want = _coef(a.asked, a.gradient_norm)
    if abs(a.coef - want) <= AGREES * want:
        return None
    return (
        f"clip differs: {a.asked_source}={a.asked:g} asks for a clip the step did not get: "
        f"the clip applied is {a.applied_source}; on this window's gradient (norm "
        f"{a.gradient_norm:.3g}) the update was multiplied by {a.coef:.3g} where "
        f"{a.asked_source}={a.asked:g} gives {want:.3g}: {a.coef / want:.3g} x the update asked "
        "for (the accumulation itself is right)"
    )


def step_findings(m: Measured) -> list[tuple[str, str]]:
    """``(pattern, sentence)`` for each part of the step beyond the accumulation that is
    wrong, in the order the module docstring gives; empty when the step is the one asked."""
    found = [("scaled clip", text) for c in m.clips if (text := _scaled(c)) is not None]
    if m.asked is not None and (text := _differs(m.asked)) is not None:
        found.append(("clip differs", text))
    return found[:2]


def clip_note(m: Measured) -> str | None:
    """Where the configured and the applied clip differ in value but not (yet) in this
    window's step: both named, and where each comes from (no note where neither clips: 0 and
    ``inf``, the Trainer's gradient norm taken for its log)."""
    a = m.asked
    if a is None or abs(a.asked - a.applied) <= 1e-12 * max(abs(a.asked), 1.0):
        return None
    if all(v <= 0 or math.isinf(v) for v in (a.asked, a.applied)):
        return None  # max_grad_norm=0 and a norm taken at max_norm=inf: no clip either way
    if _differs(a) is not None:
        return None
    first = min(v for v in (a.asked, a.applied) if v > 0)
    return (
        f"note: {a.asked_source}={a.asked:g} but the clip applied is {a.applied_source}; "
        f"this window's gradient (norm {a.gradient_norm:.3g}) is clipped by neither, so the "
        f"step is the same; steps will differ once the norm exceeds {first:g}"
    )

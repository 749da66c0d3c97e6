"""What one window's check measured, before the judge names it (:class:`Measured`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from fullbatch._probe._engines import Engine
from fullbatch._probe._fit import Fit
from fullbatch._probe._window_stat import StatisticError

__all__ = ["NO_FIT", "ClipMeasured", "Measured", "PartMeasured", "StepAsked"]

NO_FIT = Fit(())


@dataclass(frozen=True)
class ClipMeasured:
    """One clip of the window, against the gradient being judged.

    Attributes:
        source: what clipped (``"clip_grad_norm_(max_norm=1)"``, DeepSpeed's setting).
        max_norm: its max norm.
        input_norm: the norm it measured (its input).
        gradient_norm: the norm its input should have had: the applied gradient before this
            clip and any later one, over the clip's parameters (a clip before
            ``scaler.unscale_`` measures ``scale`` times it).
        coef: the coefficient it multiplied the gradients by (1.0: it did not clip).
    """

    source: str
    max_norm: float
    input_norm: float
    gradient_norm: float
    coef: float


@dataclass(frozen=True)
class StepAsked:
    """The clip a trainer was configured with against the clip applied.

    Attributes:
        asked, asked_source: the configured max norm (0: none) and where it is set
            (``"TrainingArguments.max_grad_norm"``).
        applied, applied_source: the max norm applied (0: none) and where that comes from
            (``"DeepSpeed 0.19.8's default gradient_clipping=1 (...)"``, ``"no clip"``).
        coef: the coefficient applied over the whole window (1.0: none).
        gradient_norm: the norm of the gradient being judged, before any clip.
    """

    asked: float
    asked_source: str
    applied: float
    applied_source: str
    coef: float
    gradient_norm: float


@dataclass(frozen=True)
class PartMeasured:
    """One optimizer's share of a window where several stepped together.

    Attributes:
        label: ``"optimizer 2 (AdamW: head.weight, head.bias)"``.
        error: ``‖applied − reference‖ / ‖reference‖`` over its parameters.
        tolerance: what ``error`` is held to (the window's rounding relative to this part).
        fit: the weights and the factor fitted on its parameters' sampled coordinates (where
            none falls on them, only the exact factor and its tolerance).
        applied_norm: ``‖applied‖`` over its parameters.
    """

    label: str
    error: float
    tolerance: float
    fit: Fit
    applied_norm: float


@dataclass(frozen=True)
class Measured:
    """One window's numbers; :func:`fullbatch._probe._judge.judge` decides what they mean.

    Attributes:
        step: which optimizer step ended the window (1 for the first seen in the block).
        engine: who stepped the optimizer.
        objective: the declared objective's name.
        error: ``‖applied − reference‖ / ‖reference‖`` (before any clip).
        band: the model's rounding band, relative to the window's gradient.
        tolerance: what ``error`` is held to (``fullbatch._proof._tolerance.tolerance``).
        ranks: micro-batches per rank.
        counts: each micro-batch's item count, rank by rank.
        count: ``N``, the window's item count over every rank.
        fit: the weights, the factor, the leftover and their precisions.
        unit: the coherent rounding a right engine is allowed: the unit roundoff of the least
            precise dtype the window's gradient flows through (the gradient's, the parameters',
            an autocast region's; at least float32's).
        applied_norm: ``‖applied‖`` as the optimizer will apply it (after any clip).
        ranks_differ: the largest relative difference between ranks' applied gradients.
        clip: ``(max_norm, total_norm)`` of the clip the window saw, or None.
        problem, problem_pattern: why nothing could be judged (then everything else is moot).
        parts: one per optimizer when several stepped at the window's end, in their order.
        no_backward: forwards run with gradients that reached no backward, left out.
        clips: each checkable clip of the window against the judged gradient.
        clip_source: what applied ``clip`` (``"clip_grad_norm_(max_norm=1)"``).
        asked: the configured clip against the applied one, where a trainer's setting says.
        refused: why fullbatch's own routes refuse the engine's configuration (DeepSpeed
            0.17.0's ZeRO-2 offload), so that no fix names them; None where they accept it.
        objective_source: where the objective came from (declared, inferred from a head or a
            trainer).
        statistic: a MoE window's (``causal_lm+moe``, ``dpo+moe``) load-balancing term taken
            per micro-batch: its share of the error
            (:func:`fullbatch._probe._window_stat.decompose`); the fit's weights are then the
            cross-entropy's (DPO's) alone. None for any other objective.
        units: other units of the declared objective that the loss may count in, each
            ``(name, factor)``: a loss in that unit weighs every micro-batch ``factor`` (a
            mean over a regression row's outputs too: 1/outputs).
        per_micro: a declared coupled objective's window (:mod:`fullbatch._probe._whole`):
            ``error``, ``band`` and ``fit`` (its factor alone) are against the objective over
            the whole window, and this is the applied gradient fitted on each micro-batch's
            own gradient of it (weights 1.00: the loss was taken per micro-batch); None for
            every other window.
    """

    step: int
    engine: Engine
    objective: str
    error: float = math.nan
    band: float = math.nan
    tolerance: float = math.nan
    ranks: tuple[int, ...] = (0,)
    counts: tuple[float, ...] = ()
    count: float = 0.0
    fit: Fit = NO_FIT
    unit: float = 0.0
    applied_norm: float = math.nan
    ranks_differ: float = 0.0
    clip: tuple[float, float] | None = None
    problem: str | None = None
    problem_pattern: str = "nothing to check"
    parts: tuple[PartMeasured, ...] = ()
    no_backward: int = 0
    clips: tuple[ClipMeasured, ...] = ()
    clip_source: str = ""
    asked: StepAsked | None = None
    units: tuple[tuple[str, float], ...] = ()
    objective_source: str = ""
    refused: str | None = None
    per_micro: Fit | None = None
    statistic: StatisticError | None = None

"""What ``fb.probe`` found: :class:`ProbeReport` (``.ok``, ``.windows``), :class:`WindowCheck`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["UNCHECKED", "OptimizerCheck", "ProbeReport", "WindowCheck", "which"]


def _weight(w: float) -> str:
    """A weight as printed: ``-`` for a micro-batch with no counted items (no weight)."""
    return "-" if math.isnan(w) else f"{w:.2f}"


def _fmt(value: float) -> str:
    if math.isnan(value):
        return "nan"
    return "0" if value == 0 else f"{value:.1e}"


@dataclass(frozen=True)
class OptimizerCheck:
    """One optimizer's parameters judged on their own, when several stepped at a window's end.

    ``label`` names it (``"optimizer 2 (AdamW: head.weight, head.bias)"``); ``ok`` and
    ``pattern`` its verdict; ``error``, ``tolerance``, ``factor``, ``weights`` and ``precision``
    as in :class:`WindowCheck`, over its parameters alone.
    """

    label: str
    ok: bool
    pattern: str
    error: float
    tolerance: float
    factor: float
    weights: tuple[float, ...] = ()
    precision: tuple[float, ...] = ()


@dataclass(frozen=True)
class WindowCheck:
    """One probed window: the gradient the optimizer was about to apply against the declared
    objective's gradient for the same micro-batches.

    Attributes:
        step: the window's number (1 for the first in the block; the optimizers stepped together
            at its end are one window).
        ok: the judge's verdict (``fullbatch._probe._judge``): the error is within
            ``tolerance``, every weight, the factor and the leftover within their precision of
            right, and the ranks agree (never on a zero or missing gradient or a window without
            counted items).
        error: ``‖applied − reference‖ / ‖reference‖`` (before any ``clip_grad_norm_``).
        band: the model's own rounding, measured on it (one micro-batch differentiated again
            with its loss scaled before backward and its rows reversed, times
            ``sqrt(micro_batches)``, relative to the window's gradient).
        tolerance: what ``error`` is held to: ``BAND_FACTOR`` (4) times ``band``, at least 16
            units in the last place of the parameters' dtype.
        micro_batches: micro-batches in the window, over all ranks.
        count: the declared objective's item count ``N`` over the window and all ranks.
        weights: each micro-batch's effective weight in the applied gradient divided by its
            correct weight (1.0 when right), rank by rank, in the order they ran; NaN for a
            micro-batch with no counted items (it has no correct weight: printed ``-``, and
            the report says which hold no items).
        leftover: weight of the gradient present before the window's first backward (0.0
            when right; 1.0: it was kept whole).
        precision: each weight's standard error, measured on this run (the band run's
            rounding through the fit); a weight is off beyond ``Z`` (6) of them plus the unit
            roundoff of the least precise dtype the gradient flows through (at least float32).
        factor: the applied gradient's best uniform factor on the reference (1.0 when right);
            ``factor_precision`` its standard error.
        diagnosis: a sentence: the pattern (see ``pattern``), which micro-batch and by how
            much, and the fix.
        pattern: ``"right"``, ``"mean of per-micro-batch means"``, ``"not normalized"``,
            ``"dropped"``, ``"counted twice"``, ``"leftover gradient"``, ``"ranks differ"``,
            ``"partial window"``, ``"per-rank count"``, ``"loss differs"``, ``"scaled clip"``,
            ``"clip differs"``, ``"nothing to check"``, ``"unsupported"``, ``"coupled loss"``
            (a callable objective whose rows interact: not judged per micro-batch), ``"a window
            statistic taken per micro-batch"`` (a MoE model's load balancing per micro-batch;
            ``statistic_share``) or ``"other"``.
        engine: who stepped the optimizer (e.g. ``"transformers.Trainer"``).
        objective: the declared objective's name.
        ranks: micro-batches per rank (one entry in a single process).
        clip: ``(max_norm, total_norm)`` of a ``clip_grad_norm_`` in the window, or None.
        optimizers: one line per optimizer when several stepped at the window's end (each
            judged on its own parameters: ``"optimizer 2 (AdamW: head.weight, head.bias):
            right (...)"``); empty with one optimizer.
        no_backward: forwards run with gradients whose output reached no backward (a
            validation loss without ``torch.no_grad()``): not micro-batches of the window.
        patterns: every pattern the diagnosis names, ``pattern`` first (``("mean of
            per-micro-batch means", "dropped")``, ``("scaled clip",)``).
        counts: each micro-batch's item count under the objective, in the order of
            ``weights``.
        clip_source: what applied ``clip`` (``"clip_grad_norm_(max_norm=1)"``, ``"the
            DeepSpeed config's gradient_clipping=1"``).
        clip_asked: the clip the trainer was configured with and the one applied, each with
            where it comes from; empty where no trainer setting says.
        objective_source: where the objective came from (``"declared"``, ``"inferred from
            GPT2LMHeadModel"``, ``"fullbatch.hf.ExactTrainer(loss='token')"``).
        per_optimizer: the same as ``optimizers``, as data (:class:`OptimizerCheck`).
        statistic_share: under ``causal_lm+moe`` or ``dpo+moe`` (a MoE model's router aux
            loss), the share of the error that its load-balancing loss taken per micro-batch
            explains ("a window statistic taken per micro-batch", docs/moe.md); 0.0 where it
            adds no error (the window's routing counts were used); None under any other
            objective.
    """

    step: int
    ok: bool
    error: float
    band: float
    tolerance: float
    micro_batches: int
    count: float
    weights: tuple[float, ...]
    leftover: float
    diagnosis: str
    pattern: str
    engine: str
    objective: str
    ranks: tuple[int, ...] = (1,)
    clip: tuple[float, float] | None = None
    precision: tuple[float, ...] = ()
    factor: float = math.nan
    factor_precision: float = math.nan
    optimizers: tuple[str, ...] = ()
    no_backward: int = 0
    patterns: tuple[str, ...] = ()
    counts: tuple[float, ...] = ()
    clip_source: str = ""
    clip_asked: str = ""
    objective_source: str = ""
    per_optimizer: tuple[OptimizerCheck, ...] = ()
    statistic_share: float | None = None

    def __str__(self) -> str:
        rank_text = f" on {len(self.ranks)} ranks" if len(self.ranks) > 1 else ""
        head = (
            f"window {self.step}: {'right' if self.ok else 'WRONG'} -- {self.micro_batches} "
            f"micro-batches{rank_text}, {self.count:g} items ({self.objective}); gradient error "
            f"{_fmt(self.error)} (tolerance {self.tolerance:.1e}, band {_fmt(self.band)})"
        )
        lines = [head]
        if self.weights:
            shown = " ".join(_weight(w) for w in self.weights[:16])
            more = f" ... ({len(self.weights)} in all)" if len(self.weights) > 16 else ""
            finite = [e for e in self.precision if math.isfinite(e)]
            within = f" (each ± {max(finite):.1g} or less)" if finite and max(finite) > 0 else ""
            empty = [k + 1 for k, n in enumerate(self.counts) if n == 0]
            if empty:
                which_ = ", ".join(str(k) for k in empty[:8]) + (" ..." if len(empty) > 8 else "")
                within += (
                    f"; micro-batch{'es' * (len(empty) > 1)} {which_}: no items (-), nothing "
                    "to weigh"
                )
            lines.append(f"  weights: {shown}{more}{within}")
        if math.isfinite(self.factor):
            spread = self.factor_precision
            pm = f" ± {spread:.1g}" if math.isfinite(spread) and spread > 0 else ""
            lines.append(f"  factor on the full-batch gradient: {self.factor:.4g}{pm}")
        if self.clip is not None:
            what = self.clip_source or f"clip_grad_norm_(max_norm={self.clip[0]:g})"
            lines.append(f"  {what} saw norm {self.clip[1]:.4g}: compared before the clip")
        if self.clip_asked:
            lines.append(f"  clip: {self.clip_asked}")
        if self.statistic_share is not None:
            lines.append(
                "  load balancing (router aux loss) per micro-batch: "
                f"{self.statistic_share:.0%} of the error"
            )
        lines += [f"  {line}" for line in self.optimizers]
        if self.no_backward:
            n = self.no_backward
            lines.append(
                f"  {n} forward{'s' * (n > 1)} reached no backward: not micro-batches of the "
                "window (an evaluation without torch.no_grad()?)"
            )
        lines.append(f"  {self.diagnosis}")
        return "\n".join(lines)


def which(steps: list[int]) -> str:
    """``"window 1"``, ``"windows 1-3"``, ``"windows 1-2, 5"``.

    >>> which([1]), which([1, 2, 3]), which([1, 2, 5])
    ('window 1', 'windows 1-3', 'windows 1-2, 5')
    """
    runs: list[list[int]] = []
    for step in steps:
        if runs and step == runs[-1][-1] + 1:
            runs[-1].append(step)
        else:
            runs.append([step])
    text = ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in runs)
    return f"window{'s' * (len(steps) > 1)} {text}"


#: Patterns that mean a window could not be judged at all.
UNCHECKED = ("nothing to check", "unsupported", "coupled loss")


@dataclass(frozen=True)
class ProbeReport:
    """Every probed window, and what kept the probe from checking.

    ``ok`` is True only when at least one window was checked, every checked window is right
    and nothing was left unchecked (``problems`` is empty): the probe never passes on nothing.
    ``requested`` is how many windows were asked for (None: every window); the text says which
    windows were checked, and when the run ended before the number asked for. ``failure``:
    what ended the run with an error, when it did (the script's exception or exit status);
    the text then heads with ``FAILED``, whatever the windows checked before it were.
    """

    windows: tuple[WindowCheck, ...] = ()
    problems: tuple[str, ...] = field(default_factory=tuple)
    engine: str = ""
    requested: int | None = 2
    failure: str = ""

    @property
    def ok(self) -> bool:
        return bool(self.windows) and all(w.ok for w in self.windows) and not self.problems

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data, versioned (``schema_version``): every field, each
        window's included (docs/probe.md, "The report as data")."""
        from fullbatch._probe._export import report_dict

        return report_dict(self)

    @property
    def verdict(self) -> str:
        """One word for a machine: "wrong", "failed" (after right windows), "right" or
        "nothing checked"."""
        if any(not w.ok and w.pattern not in UNCHECKED for w in self.windows):
            return "wrong"
        if self.failure:
            return "failed"
        return "right" if self.ok else "nothing checked"

    @property
    def checked(self) -> bool:
        """Whether at least one window was judged (not only "nothing to check")."""
        return any(w.pattern not in UNCHECKED for w in self.windows)

    def __str__(self) -> str:
        steps = [w.step for w in self.windows]
        wrong = [w.step for w in self.windows if not w.ok]
        engine = f", {self.engine}" if self.engine else ""
        if self.failure and self.ok:
            verdict = f"FAILED after right windows ({which(steps)} checked{engine})"
        elif self.ok:
            verdict = f"RIGHT ({which(steps)} checked{engine})"
        elif len(steps) == 1:
            verdict = f"WRONG ({which(steps)} checked{engine})"
        elif self.windows:
            verdict = f"WRONG ({which(wrong)} wrong of {which(steps)} checked{engine})"
        else:
            verdict = f"NOTHING CHECKED (0 windows{engine})"
        lines = [f"fullbatch probe: {verdict}"]
        lines += [str(w) for w in self.windows]
        lines += [f"problem: {p}" for p in self.problems]
        if self.failure:
            lines.append(f"failed: {self.failure}")
        if self.requested is not None and 0 < len(steps) < self.requested and not self.problems:
            lines.append(
                f"note: only {which(steps)} checked: the run ended before window {steps[-1] + 1} "
                f"(windows={self.requested})"
            )
        return "\n".join(lines)

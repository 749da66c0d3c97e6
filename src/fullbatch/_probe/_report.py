"""What ``fb.probe`` found: :class:`ProbeReport` (``.ok``, ``.windows``), :class:`WindowCheck`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["ProbeReport", "WindowCheck"]


def _fmt(value: float) -> str:
    if math.isnan(value):
        return "nan"
    return "0" if value == 0 else f"{value:.1e}"


@dataclass(frozen=True)
class WindowCheck:
    """One probed window: the gradient the optimizer was about to apply against the declared
    objective's gradient for the same micro-batches.

    Attributes:
        step: which optimizer step this window ended (1 for the first seen in the block).
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
            correct weight (1.0 when right), rank by rank, in the order they ran.
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
            ``"partial window"``, ``"per-rank count"``, ``"loss differs"``, ``"nothing to
            check"``, ``"unsupported"`` or ``"other"``.
        engine: who stepped the optimizer (e.g. ``"transformers.Trainer"``).
        objective: the declared objective's name.
        ranks: micro-batches per rank (one entry in a single process).
        clip: ``(max_norm, total_norm)`` of a ``clip_grad_norm_`` in the window, or None.
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

    def __str__(self) -> str:
        rank_text = f" on {len(self.ranks)} ranks" if len(self.ranks) > 1 else ""
        head = (
            f"window {self.step}: {'right' if self.ok else 'WRONG'} -- {self.micro_batches} "
            f"micro-batches{rank_text}, {self.count:g} items ({self.objective}); gradient error "
            f"{_fmt(self.error)} (tolerance {self.tolerance:.1e}, band {_fmt(self.band)})"
        )
        lines = [head]
        if self.weights:
            shown = " ".join("nan" if math.isnan(w) else f"{w:.2f}" for w in self.weights[:16])
            more = f" ... ({len(self.weights)} in all)" if len(self.weights) > 16 else ""
            finite = [e for e in self.precision if math.isfinite(e)]
            within = f" (each ± {max(finite):.1g} or less)" if finite and max(finite) > 0 else ""
            lines.append(f"  weights: {shown}{more}{within}")
        if math.isfinite(self.factor):
            spread = self.factor_precision
            pm = f" ± {spread:.1g}" if math.isfinite(spread) and spread > 0 else ""
            lines.append(f"  factor on the full-batch gradient: {self.factor:.4g}{pm}")
        if self.clip is not None:
            lines.append(
                f"  clip_grad_norm_(max_norm={self.clip[0]:g}) saw norm {self.clip[1]:.4g}: "
                "compared before the clip"
            )
        lines.append(f"  {self.diagnosis}")
        return "\n".join(lines)


@dataclass(frozen=True)
class ProbeReport:
    """Every probed window, and what kept the probe from checking.

    ``ok`` is True only when at least one window was checked, every checked window is right
    and nothing was left unchecked (``problems`` is empty): the probe never passes on nothing.
    """

    windows: tuple[WindowCheck, ...] = ()
    problems: tuple[str, ...] = field(default_factory=tuple)
    engine: str = ""

    @property
    def ok(self) -> bool:
        return bool(self.windows) and all(w.ok for w in self.windows) and not self.problems

    def __str__(self) -> str:
        wrong = sum(not w.ok for w in self.windows)
        if self.ok:
            verdict = f"RIGHT ({len(self.windows)} window{'s' * (len(self.windows) > 1)} checked"
        elif self.windows:
            verdict = f"WRONG ({wrong} of {len(self.windows)} windows wrong"
        else:
            verdict = "NOTHING CHECKED (0 windows"
        engine = f", {self.engine}" if self.engine else ""
        lines = [f"fullbatch probe: {verdict}{engine})"]
        lines += [str(w) for w in self.windows]
        lines += [f"problem: {p}" for p in self.problems]
        return "\n".join(lines)

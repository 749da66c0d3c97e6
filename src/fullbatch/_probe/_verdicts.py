"""The report of a probe: each measured window judged (:mod:`fullbatch._probe._judge`) and put
in the public shape (:class:`fullbatch._probe._report.WindowCheck`)."""

from __future__ import annotations

from fullbatch._probe._judge import judge
from fullbatch._probe._judge_coupled import judge_coupled
from fullbatch._probe._measured import Measured
from fullbatch._probe._report import OptimizerCheck, ProbeReport, WindowCheck

__all__ = ["report_of"]


def _asked(m: Measured) -> str:
    """The configured clip and the applied one, each with where it comes from."""
    a = m.asked
    if a is None:
        return ""
    asked = f"{a.asked_source}={a.asked:g}" if a.asked > 0 else f"{a.asked_source}=0 (no clip)"
    return f"asked {asked}; applied: {a.applied_source}"


def report_of(measured: list[Measured], problems: list[str], limit: int | None) -> ProbeReport:
    """Every window checked, and what kept the probe from checking; ``limit``: the windows
    asked for (None: every one).

    >>> str(report_of([], [], 2)).splitlines()[0]
    'fullbatch probe: NOTHING CHECKED (0 windows)'
    """
    k_max = max((len(m.counts) for m in measured), default=0)
    checks = []
    for m in measured:
        verdict = judge(m, k_max) if m.per_micro is None else judge_coupled(m, k_max)
        check = WindowCheck(
            step=m.step, ok=verdict.ok, error=m.error, band=m.band, tolerance=m.tolerance,
            micro_batches=len(m.counts), count=m.count, weights=m.fit.weights,
            leftover=m.fit.leftover, diagnosis=verdict.sentence, pattern=verdict.pattern,
            engine=m.engine.name, objective=m.objective, ranks=m.ranks, clip=m.clip,
            precision=m.fit.stderr, factor=m.fit.factor, factor_precision=m.fit.factor_stderr,
            optimizers=verdict.parts, no_backward=m.no_backward, patterns=verdict.patterns,
            counts=m.counts, clip_source=m.clip_source, clip_asked=_asked(m),
            objective_source=m.objective_source,
            per_optimizer=_per_optimizer(m, verdict.parts),
            statistic_share=_share(m),
        )  # fmt: skip
        checks.append(check)
    said = list(problems)
    if not checks and not said:
        said.append(
            "nothing to check: no optimizer step was seen inside the block (the training "
            "ended before its first step, or its optimizer is not a torch.optim.Optimizer)"
        )
    engines = ", ".join(sorted({m.engine.name for m in measured}))
    return ProbeReport(tuple(checks), tuple(said), engines, limit)


def _share(m: Measured) -> float | None:
    """The share of the error a per-micro-batch load-balancing loss explains (MoE windows);
    0.0 where it is within the tolerance (nothing of it to name)."""
    stat = m.statistic
    if stat is None:
        return None
    return stat.share if stat.error > m.tolerance else 0.0


def _per_optimizer(m: Measured, lines: tuple[str, ...]) -> tuple[OptimizerCheck, ...]:
    """Each optimizer's part as data, its verdict read from the judge's line for it
    (``"<label>: right (...)"`` or ``"<label>: WRONG, <pattern> (...)"``)."""
    if len(lines) != len(m.parts):
        return ()
    out = []
    for part, line in zip(m.parts, lines, strict=True):
        said = line.removeprefix(f"{part.label}: ").split(" (error")[0]
        ok = said == "right"
        out.append(
            OptimizerCheck(
                label=part.label, ok=ok, pattern="right" if ok else said.removeprefix("WRONG, "),
                error=part.error, tolerance=part.tolerance, factor=part.fit.factor,
                weights=part.fit.weights, precision=part.fit.stderr,
            )
        )  # fmt: skip
    return tuple(out)

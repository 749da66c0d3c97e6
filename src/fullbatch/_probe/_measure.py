"""Close a window over every rank: its error, its weights and its ranks compared.

:func:`close` gathers what each rank read (:class:`fullbatch._probe._window.OpenWindow`): the
sums of every optimizer's comparison, each micro-batch's sampled gradient and count, and the
sampled applied gradient, leftover and band sample; then fits each micro-batch's weight
(:mod:`fullbatch._probe._fit`) on the whole window and, when several optimizers stepped, on
each one's parameters. Every rank computes the same numbers from the same gathered values
(the error is the largest over the ranks, the fit is the first rank's), so every rank reaches
the same verdict. The judge (:mod:`fullbatch._probe._judge`) decides what they mean.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fullbatch._probe._clip import Clip
from fullbatch._probe._fit import Fit, fit
from fullbatch._probe._measured import NO_FIT, ClipMeasured, Measured, PartMeasured, StepAsked
from fullbatch._probe._whole import whole_fit
from fullbatch._probe._window import OpenWindow
from fullbatch._probe._window_stat import decompose
from fullbatch._proof._tolerance import tolerance, unit_roundoff

__all__ = ["close"]


def _gather_rows(sync: Any, rows: torch.Tensor, sizes: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Every rank's ``[k_r, m_r]`` matrix (padded for the all-gather, unpadded after)."""
    k_max = max(k for k, _ in sizes)
    m_max = max(m for _, m in sizes)
    padded = torch.zeros(k_max, m_max, dtype=torch.float64)
    padded[: rows.shape[0], : rows.shape[1]] = rows
    every = sync.all_gather(padded)
    return [every[r, :k, :m] for r, (k, m) in enumerate(sizes)]


def _eps_dtype(dtypes: list[torch.dtype]) -> torch.dtype:
    floating = [d for d in dtypes if d.is_floating_point]
    return max(floating, key=lambda d: torch.finfo(d).eps) if floating else torch.float64


def _problem(name: str, k_total: int, count: float, applied_norm: float, clips: list[Clip],
             no_backward: int) -> tuple[str | None, str]:  # fmt: skip
    if any(math.isnan(c.coef) for c in clips):
        return (
            "clip_grad_value_ clipped the gradient entry by entry, which no full-batch "
            "gradient equals: probe a run without it"
        ), "unsupported"
    if k_total == 0 and no_backward:
        return (
            f"nothing to check: {no_backward} forward{'s' * (no_backward > 1)} ran with "
            "gradients but reached no backward since the last step (an evaluation without "
            "torch.no_grad(), or a loss never backpropagated)"
        ), "nothing to check"
    if k_total == 0:
        return (
            "nothing to check: no micro-batch ran a module this optimizer trains since its last "
            "step (the model ran without gradients, or the engine runs it outside nn.Module "
            "calls)"
        ), "nothing to check"
    if count == 0:
        return (
            f"nothing to check: the window's {k_total} micro-batches hold no counted items "
            f"under the {name} objective (every label ignored?)"
        ), "nothing to check"
    if applied_norm == 0:
        return (
            f"dropped: no gradient reached the optimizer's parameters at step() (zero or "
            f"missing gradient) although {k_total} micro-batches ran"
        ), "dropped"
    return None, "nothing to check"


def _relative(diff: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest over ranks of ``sqrt(diff_r / ref_r)``."""
    pairs = zip(diff.tolist(), ref.tolist(), strict=True)
    errors = [math.sqrt(d / r) for d, r in pairs if r > 0]
    return max(errors) if errors else math.nan


def close(open_window: OpenWindow) -> Measured:
    """Measure the window (see the module docstring)."""
    w, sync, every = open_window, open_window.sync, open_window.header
    window, rec = w.window, w.rec
    sizes = [(int(every[r, 0]), int(every[r, 2])) for r in range(sync.world)]
    per_rank = tuple(k for k, _ in sizes)
    count = w.count
    k_total = sum(per_rank)
    m_local = w.sampler.size if w.sampler is not None else 0

    # every rank's sums, per optimizer: [diff, ref, applied, raw]
    sums = torch.tensor([[p.diff, p.ref, p.applied, p.raw] for p in w.parts], dtype=torch.float64)
    all_sums = sync.all_gather(sums.reshape(-1, 4))  # [world, parts, 4]
    total = all_sums.sum(dim=1)  # [world, 4]
    error = _relative(total[:, 0], total[:, 1])
    applied_norm = math.sqrt(float(total[:, 2].max()))
    raw_norm = math.sqrt(float(total[0, 3]))
    delta_norm = float(every[:, 4].max())
    band = math.sqrt(k_total) * delta_norm / raw_norm if raw_norm > 0 else math.nan
    params = [p for p in w.params if any(id(p) in part.ids for part in w.parts)]
    eps = _eps_dtype([p.dtype for p in params])
    tol = tolerance(band, eps)
    held = unit_roundoff(_eps_dtype(w.dtypes))
    # a right engine may round values coherently (a scalar 1/N, nearly equal logit gradients)
    # in any dtype the window's gradient flows through: the gradient's, the parameters', an
    # autocast region's, and at least float32 (loss paths upcast to it)
    flows = [torch.float32, *(p.dtype for p in params),
             *(d for c in window.calls for _, d in c.autocast)]  # fmt: skip
    unit = max(held, unit_roundoff(_eps_dtype(flows)))

    counts_local = rec.counts if rec is not None else []
    local_rows = torch.zeros(len(counts_local), m_local + 1, dtype=torch.float64)
    # applied/clip, leftover, δ, raw; a MoE window's aux gradients: own counts, the window's
    vectors = torch.zeros(4 if w.moe is None else 6, m_local + 1, dtype=torch.float64)
    if rec is not None and w.sampler is not None and w.applied is not None:
        assert w.divisor is not None
        local_rows[:, 0] = torch.tensor(counts_local, dtype=torch.float64)
        local_rows[:, 1:] = torch.stack(rec.samples)
        vectors[0, 1:] = w.applied / w.divisor
        mine = window.calls_of(w.params)
        if mine and id(mine[0].module) in window.leftovers:
            vectors[1, 1:] = window.leftovers[id(mine[0].module)]
        if rec.delta is not None:
            vectors[2, 1:] = rec.delta
        vectors[3, 1:] = w.applied
        if w.moe is not None and w.moe.own is not None:
            vectors[4, 1:] = w.moe.own
            vectors[5, 1:] = sum(w.moe.win)
    rows = _gather_rows(sync, local_rows, [(k, m + 1) for k, m in sizes])
    all_vectors = _gather_rows(sync, vectors, [(len(vectors), m + 1) for _, m in sizes])
    m_max = max(m for _, m in sizes)
    with_sampler = [r for r, (_, m) in enumerate(sizes) if m == m_max and m > 0]
    counts = tuple(float(v) for r in rows for v in r[:, 0].tolist())
    differ, result, statistic = 0.0, NO_FIT, None
    parts: tuple[PartMeasured, ...] = ()
    if with_sampler and k_total > 0:
        first = all_vectors[with_sampler[0]]
        base = float(first[3, 1:].norm())
        for r in with_sampler[1:]:
            if base > 0:
                differ = max(differ, float((all_vectors[r][3, 1:] - first[3, 1:]).norm()) / base)
        samples = torch.cat([r[:, 1:] for r in rows if r.shape[1] == m_max + 1 and r.shape[0]])
        left = sum(all_vectors[r][1, 1:] for r in with_sampler) / len(with_sampler)
        banded = max(with_sampler, key=lambda r: float(every[r, 4]))
        judged = first[0, 1:]  # the applied gradient the weights are fitted on
        if w.moe is not None:  # its aux part measured, the cross-entropy part fitted
            own, win = (torch.stack([all_vectors[r][i, 1:] for r in with_sampler]).sum(0)
                        for i in (4, 5))  # fmt: skip
            kept = left if isinstance(left, torch.Tensor) else None
            statistic, judged = decompose(samples, judged, kept, own, win, count, w.moe.aux.coef)

        def fitted(mask: torch.Tensor | None) -> Fit:
            pick = slice(None) if mask is None else mask
            sub, delta = samples[:, pick], all_vectors[banded][2, 1:][pick]
            whole, share = float(samples.pow(2).sum()), float(sub.pow(2).sum())
            if share == 0:
                return NO_FIT
            return fit(
                sub, left[pick] if isinstance(left, torch.Tensor) else None, judged[pick],
                count, delta=delta * math.sqrt(whole / share), unit=held, counts=counts,
                band_count=float(every[banded, 5]),
            )  # fmt: skip

        result = fitted(None)
        if len(w.parts) > 1:
            parts = tuple(
                _part(part.label, all_sums[:, i], fitted(mask), k_total, delta_norm, eps, count)
                for i, (part, mask) in enumerate(zip(w.parts, w.masks(), strict=True))
            )

    per_micro = None
    if w.whole is not None and result is not NO_FIT:  # a declared coupled objective
        per_micro, parts = result, ()  # judged on the whole window's reference alone
        band, tol, result = whole_fit(w.whole, total[0], k_total, raw_norm, eps)
    problem, pattern = _problem(w.objective, k_total, count, applied_norm, window.clips,
                                window.no_backward)  # fmt: skip
    if problem is None and w.coupled is not None:
        problem, pattern = w.coupled, "coupled loss"
    clipped = [c for c in window.clips if c.coef < 1.0]  # a clip that only measured: none
    last = clipped[-1] if clipped else None
    clips, asked = _clip_facts(w)
    return Measured(
        step=window.step, engine=w.engine, objective=w.objective, error=error, band=band,
        tolerance=tol, ranks=per_rank, counts=counts, count=count, fit=result, unit=unit,
        applied_norm=applied_norm, ranks_differ=differ,
        clip=None if last is None else (last.max_norm, last.total_norm),
        problem=problem, problem_pattern=pattern, parts=parts, no_backward=window.no_backward,
        clips=clips, asked=asked, units=w.units, clip_source=last.source if last else "",
        objective_source=w.objective_source, refused=w.refused, per_micro=per_micro,
        statistic=statistic,
    )  # fmt: skip


def _clip_facts(w: OpenWindow) -> tuple[tuple[ClipMeasured, ...], StepAsked | None]:
    """Each clip whose parameters were all read, against the gradient it should have measured;
    and, where the trainer was configured with a clip, that clip against the applied one."""
    facts = []
    for i, c in enumerate(w.window.clips):
        if not math.isfinite(c.coef) or not c.params or c.params - w.clip_covered.get(i, set()):
            continue
        facts.append(ClipMeasured(c.source, c.max_norm, c.total_norm,
                                  math.sqrt(w.clip_sq.get(i, 0.0)), c.coef))  # fmt: skip
    asked = w.engine.clip_asked
    if asked is None or w.engine.fullbatch or w.judged_sq <= 0:
        return tuple(facts), None
    applied_norm = math.sqrt(sum(p.applied for p in w.parts))
    gradient_norm = math.sqrt(w.judged_sq)
    norms = [c for c in w.window.clips if math.isfinite(c.coef)]
    if norms:
        applied, source = norms[-1].max_norm, norms[-1].source
    elif w.setting is not None:
        applied, source = w.setting
    else:
        applied, source = 0.0, "no clip seen (neither clip_grad_norm_ nor the engine's own)"
    step = StepAsked(asked[0], asked[1], applied, source, applied_norm / gradient_norm,
                     gradient_norm)  # fmt: skip
    return tuple(facts), step


def _part(label: str, sums: torch.Tensor, part_fit: Fit, k_total: int, delta_norm: float,
          eps: torch.dtype, count: float) -> PartMeasured:  # fmt: skip
    """One optimizer's share: its error (largest over ranks), its band and tolerance (the
    window's rounding relative to this part's gradient), its fit; where no sampled coordinate
    falls on its parameters, the fit is its exact uniform factor alone."""
    error = _relative(sums[:, 0], sums[:, 1])
    diff, ref, applied, raw = (float(v) for v in sums[0])
    band = math.sqrt(k_total) * delta_norm / math.sqrt(raw) if raw > 0 else math.nan
    if not part_fit.weights and ref > 0:
        factor = (applied + ref - diff) / (2 * ref)  # <a, r> / <r, r>, from the three sums
        part_fit = Fit((), factor=factor, factor_stderr=band)
    return PartMeasured(label, error, tolerance(band, eps), part_fit, math.sqrt(applied))

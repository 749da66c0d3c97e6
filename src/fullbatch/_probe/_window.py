"""One window at ``step()``: the reference against the applied gradient, over every rank.

:func:`measure` recomputes the reference (:mod:`fullbatch._probe._reference`), reads the applied
gradient through the window's reader (:mod:`fullbatch._probe._applied`), compares them and fits
each micro-batch's weight (:mod:`fullbatch._probe._fit`); the judge decides what it means.

Every rank runs the same collectives in the same order whatever it found (a rank whose
recompute failed says so in the header, and then every rank raises), so a failure never leaves
a rank waiting. The reference ``Σ_rk ∇S_rk / N`` is one gradient-sized buffer summed over the
ranks; the per-micro-batch samples, counts, the band sample and the applied gradients travel
as small sampled vectors.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fullbatch._base._sync._probe import probe_sync
from fullbatch._probe._applied import AppliedGradient
from fullbatch._probe._call_loss import resolve
from fullbatch._probe._capture import Call
from fullbatch._probe._clip import Clip
from fullbatch._probe._engines import Engine
from fullbatch._probe._fit import fit
from fullbatch._probe._measured import NO_FIT, Measured
from fullbatch._probe._reference import LocalReference, recompute, summed_over_ranks
from fullbatch._probe._sample import Sampler
from fullbatch._proof._norms import squared
from fullbatch._proof._tolerance import tolerance, unit_roundoff

__all__ = ["WindowData", "measure", "trained"]


def trained(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    """The parameters ``optimizer`` updates (requires_grad), each once, in its order."""
    seen: dict[int, nn.Parameter] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                seen.setdefault(id(p), p)
    return list(seen.values())


@dataclass
class WindowData:
    """What the probe recorded for one window, handed to :func:`measure`.

    Attributes:
        step: which optimizer step ends it.
        calls: the micro-batches the model ran since the previous step.
        optimizers: every optimizer stepped at the window's end (its parameters are checked
            together: ``params`` is their union, each once).
        leftovers: per module, the sampled gradient present at its first forward.
        clips: the ``clip_grad_norm_`` calls of the window, on these parameters.
    """

    step: int
    calls: list[Call]
    optimizers: list[torch.optim.Optimizer]
    leftovers: dict[int, torch.Tensor] = field(default_factory=dict)
    clips: list[Clip] = field(default_factory=list)

    @property
    def params(self) -> list[nn.Parameter]:
        seen: dict[int, nn.Parameter] = {}
        for optimizer in self.optimizers:
            for p in trained(optimizer):
                seen.setdefault(id(p), p)
        return list(seen.values())

    def calls_of(self, params: list[nn.Parameter]) -> list[Call]:
        """The calls of a module that holds one of ``params``."""
        ids = {id(p) for p in params}
        return [c for c in self.calls if any(id(p) in ids for p in c.module.parameters())]


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


def _problem(name: str, k_total: int, count: float, applied_norm: float, clips: list[Clip]):
    if any(math.isnan(c.coef) for c in clips):
        return (
            "clip_grad_value_ clipped the gradient entry by entry, which no full-batch "
            "gradient equals: probe a run without it"
        ), "unsupported"
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


def measure(
    window: WindowData,
    reader: AppliedGradient,
    *,
    sampler_for: Callable[[nn.Module], Sampler],
    objective: Any,
    ranks: Any,
    engine: Engine,
) -> Measured:
    """Measure one window (see the module docstring); raises on every rank when the
    declared objective cannot be computed on one of them."""
    params = window.params
    mine = window.calls_of(params)
    wrapper = next((c.wrapper for c in mine if c.wrapper is not None), None)
    sync = probe_sync(wrapper, ranks)
    name = objective if isinstance(objective, str) else "inferred"
    sampler = sampler_for(mine[0].module) if mine else None
    failure: BaseException | None = None
    rec: LocalReference | None = None
    read = reader.params()
    if mine:
        assert sampler is not None
        try:
            name, fn = resolve(objective, mine[0].module)
            rec = recompute(mine, read, sampler, fn)
        except (ValueError, TypeError, RuntimeError) as raised:
            failure = raised
    m_local = sampler.size if sampler is not None else 0
    local_counts = rec.counts if rec is not None else []
    header = torch.tensor(
        [len(local_counts), sum(local_counts), m_local, failure is not None,
         rec.band if rec is not None else 0.0, rec.band_count if rec is not None else 0.0],
        dtype=torch.float64,
    )  # fmt: skip
    every = sync.all_gather(header)
    if bool(every[:, 3].any()):
        if failure is not None:
            raise failure
        bad = [r for r in range(sync.world) if every[r, 3]]
        raise RuntimeError(f"fb.probe could not recompute the window on rank(s) {bad}; see there.")
    sizes = [(int(every[r, 0]), int(every[r, 2])) for r in range(sync.world)]
    per_rank = tuple(k for k, _ in sizes)
    count = float(every[:, 1].sum())
    k_total = sum(per_rank)

    ref = summed_over_ranks(rec, params, sync)  # Σ_rk ∇S_rk
    ref_norm = math.sqrt(squared(ref))
    coef = math.prod(c.coef for c in window.clips)
    if count > 0:
        torch._foreach_mul_(ref, coef / count)  # the reference, clipped as the engine did
    grads = reader.applied()
    applied = grads[: len(params)]
    scaled_sq = squared(ref)
    error = math.sqrt(squared(applied, ref) / scaled_sq) if scaled_sq > 0 else math.nan
    applied_norm = math.sqrt(squared(applied))
    del ref
    band = math.sqrt(k_total) * float(every[:, 4].max()) / ref_norm if ref_norm > 0 else math.nan
    tol = tolerance(band, _eps_dtype([p.dtype for p in params]))
    held = unit_roundoff(_eps_dtype([g.dtype for g in applied if g is not None]))
    # a right engine may round values coherently (a scalar 1/N, nearly equal logit gradients)
    # in any dtype the window's gradient flows through: the gradient's, the parameters', an
    # autocast region's, and at least float32 (loss paths upcast to it)
    flows = [torch.float32, *(p.dtype for p in params), *(d for c in mine for _, d in c.autocast)]
    unit = max(held, unit_roundoff(_eps_dtype(flows)))

    local_rows = torch.zeros(len(local_counts), m_local + 1, dtype=torch.float64)
    vectors = torch.zeros(3, m_local + 1, dtype=torch.float64)  # applied, leftover, δ
    if rec is not None and sampler is not None:
        local_rows[:, 0] = torch.tensor(local_counts, dtype=torch.float64)
        local_rows[:, 1:] = torch.stack(rec.samples)
        by_id = {id(p): g for p, g in zip(read, grads, strict=True)}
        vectors[0, 1:] = sampler.take([by_id.get(id(p)) for p in sampler.params])
        if id(mine[0].module) in window.leftovers:
            vectors[1, 1:] = window.leftovers[id(mine[0].module)]
        if rec.delta is not None:
            vectors[2, 1:] = rec.delta
    del grads
    rows = _gather_rows(sync, local_rows, [(k, m + 1) for k, m in sizes])
    m_max = max(m for _, m in sizes)
    all_vectors = _gather_rows(sync, vectors, [(3, m + 1) for _, m in sizes])
    with_sampler = [r for r, (_, m) in enumerate(sizes) if m == m_max and m > 0]
    differ = 0.0
    mine_a = vectors[0, 1:] if m_local == m_max else None
    if mine_a is not None and float(mine_a.norm()) > 0:
        for r in with_sampler:
            diff = float((all_vectors[r][0, 1:] - mine_a).norm()) / float(mine_a.norm())
            differ = max(differ, diff)
    counts = tuple(float(v) for r in rows for v in r[:, 0].tolist())
    result = NO_FIT
    if mine_a is not None and k_total > 0 and m_max > 0:
        samples = torch.cat([r[:, 1:] for r in rows if r.shape[1] == m_max + 1 and r.shape[0]])
        left = sum(all_vectors[r][1, 1:] for r in with_sampler) / max(len(with_sampler), 1)
        banded = max(with_sampler, key=lambda r: float(every[r, 4]))
        result = fit(
            samples, left if isinstance(left, torch.Tensor) else None, mine_a / coef, count,
            delta=all_vectors[banded][2, 1:], unit=held, counts=counts,
            band_count=float(every[banded, 5]),
        )  # fmt: skip

    problem, pattern = _problem(name, k_total, count, applied_norm, window.clips)
    clipped = [c for c in window.clips if c.coef < 1.0]  # a clip that only measured: none
    last = clipped[-1] if clipped else None
    return Measured(
        step=window.step, engine=engine, objective=name, error=error, band=band,
        tolerance=tol, ranks=per_rank, counts=counts, count=count, fit=result, unit=unit,
        applied_norm=applied_norm, ranks_differ=differ,
        clip=None if last is None else (last.max_norm, last.total_norm),
        problem=problem, problem_pattern=pattern,
    )  # fmt: skip

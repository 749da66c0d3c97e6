"""Check one window at ``step()``: recompute, sum over ranks, compare, fit the weights.

Every rank runs the same collectives in the same order whatever it found (a rank whose
recompute failed says so in the header, and then every rank raises), so a failure never
leaves a rank waiting. The reference ``Σ_rk ∇S_rk / N`` is one gradient-sized buffer summed
over the ranks; the per-micro-batch samples, counts and applied gradients travel as small
sampled vectors.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from fullbatch._base._sync._probe import probe_sync, sum_tensors
from fullbatch._probe._capture import Call
from fullbatch._probe._clip import Clip
from fullbatch._probe._diagnose import Measured
from fullbatch._probe._fit import Fit, fit
from fullbatch._probe._norms import squared
from fullbatch._probe._objective import resolve
from fullbatch._probe._recompute import recompute
from fullbatch._probe._sample import Sampler
from fullbatch._probe._where import Engine
from fullbatch._verify._hf_check import FLOOR_ULPS
from fullbatch._verify._precision import BAND_CAP, BAND_FACTOR

__all__ = ["check_window", "trained", "unsupported_params"]

_NO_FIT = Fit((), 0.0, 0.0)


def trained(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    """The parameters ``optimizer`` updates (requires_grad), each once, in its order."""
    seen: dict[int, nn.Parameter] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                seen.setdefault(id(p), p)
    return list(seen.values())


def unsupported_params(params: list[nn.Parameter]) -> str | None:
    """Why gradients of ``params`` are not the full gradients at ``step()``, or None."""
    if any(getattr(p, "_is_flat_param", False) for p in params):
        return "the optimizer trains FSDP1 flat parameters, whose .grad is a flattened shard"
    if any(hasattr(p, "_local_tensor") for p in params):
        return "the optimizer trains DTensor parameters (FSDP2 or tensor parallelism)"
    return None


def _tolerance(band: float, params: list[nn.Parameter]) -> float:
    eps = max((torch.finfo(p.dtype).eps for p in params if p.is_floating_point()), default=0.0)
    floor = FLOOR_ULPS * eps
    if not band <= BAND_CAP:  # NaN or no rounding: the floor alone
        return floor
    return max(BAND_FACTOR * band, floor)


def _zeros(p: nn.Parameter) -> torch.Tensor:
    """Zeros in the dtype the reference keeps for ``p`` (low precision summed in float32)."""
    low = p.dtype in (torch.bfloat16, torch.float16)
    return torch.zeros_like(p, dtype=torch.float32 if low else p.dtype)


def _gather_rows(sync: Any, rows: torch.Tensor, sizes: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Every rank's ``[k_r, m_r]`` matrix (padded for the all-gather, unpadded after)."""
    k_max = max(k for k, _ in sizes)
    m_max = max(m for _, m in sizes)
    padded = torch.zeros(k_max, m_max, dtype=torch.float64)
    padded[: rows.shape[0], : rows.shape[1]] = rows
    every = sync.all_gather(padded)
    return [every[r, :k, :m] for r, (k, m) in enumerate(sizes)]


def check_window(
    *,
    step: int,
    calls: list[Call],
    optimizer: torch.optim.Optimizer,
    sampler_for: Any,
    leftovers: dict[int, torch.Tensor],
    objective: Any,
    ranks: Any,
    clips: list[Clip],
    engine: Engine,
) -> Measured:
    """Measure one window (see the module docstring); raises on every rank when the
    declared objective cannot be computed on one of them."""
    params = trained(optimizer)
    why = unsupported_params(params)
    if why is not None:  # the same on every rank: no collective
        return Measured(
            step=step, engine=engine, objective=str(objective), ok=False, error=math.nan,
            band=math.nan, tolerance=math.nan, ranks=(0,), counts=(), count=0.0, fit=_NO_FIT,
            problem=f"unsupported: {why}; the probe needs each parameter's full gradient in "
            ".grad at step()", problem_pattern="unsupported",
        )  # fmt: skip
    ids = {id(p) for p in params}
    mine = [c for c in calls if any(id(p) in ids for p in c.module.parameters())]
    wrapper = next((c.wrapper for c in mine if c.wrapper is not None), None)
    sync = probe_sync(wrapper, ranks)
    name = objective if isinstance(objective, str) else "inferred"
    sampler: Sampler | None = sampler_for(mine[0].module) if mine else None
    failure: BaseException | None = None
    rec = None
    if mine:
        assert sampler is not None
        extra = [p for p in sampler.params if id(p) not in ids]
        try:
            name, fn = resolve(objective, mine[0].module)
            rec = recompute(mine, params + extra, sampler, fn)
        except (ValueError, TypeError, RuntimeError) as raised:
            failure = raised
    m_local = sampler.size if sampler is not None else 0
    local_counts = rec.counts if rec is not None else []
    header = torch.tensor(
        [len(local_counts), sum(local_counts), m_local, failure is not None,
         rec.band if rec is not None else 0.0],
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

    ref = rec.ref[: len(params)] if rec is not None else [None] * len(params)
    ref_full = [_zeros(p) if r is None else r for p, r in zip(params, ref, strict=True)]
    if sync.world > 1:
        sum_tensors(ref_full, sync.group)
    ref_norm = math.sqrt(squared(ref_full))  # ‖Σ_rk ∇S_rk‖
    coef = math.prod(c.coef for c in clips)
    if count > 0:
        torch._foreach_mul_(ref_full, coef / count)  # the reference, clipped as the engine did
    grads = [p.grad for p in params]
    scaled_sq = squared(ref_full)
    error = math.sqrt(squared(grads, ref_full) / scaled_sq) if scaled_sq > 0 else math.nan
    applied_norm = math.sqrt(squared(grads))
    band = math.sqrt(k_total) * float(every[:, 4].max()) / ref_norm if ref_norm > 0 else math.nan
    tol = _tolerance(band, params)

    local_rows = torch.zeros(len(local_counts), m_local + 1, dtype=torch.float64)
    applied = torch.zeros(1, m_local + 1, dtype=torch.float64)
    leftover = torch.zeros(1, m_local + 1, dtype=torch.float64)
    if rec is not None and sampler is not None:
        local_rows[:, 0] = torch.tensor(local_counts, dtype=torch.float64)
        local_rows[:, 1:] = torch.stack(rec.samples)
        applied[0, 1:] = sampler.take([p.grad for p in sampler.params])
        if id(mine[0].module) in leftovers:
            leftover[0, 1:] = leftovers[id(mine[0].module)]
    rows = _gather_rows(sync, local_rows, [(k, m + 1) for k, m in sizes])
    m_max = max(m for _, m in sizes)
    one = [(1, m + 1) for _, m in sizes]
    applied_all = _gather_rows(sync, applied, one)
    leftover_all = _gather_rows(sync, leftover, one)
    with_sampler = [r for r, (_, m) in enumerate(sizes) if m == m_max and m > 0]
    differ = 0.0
    mine_a = applied[0, 1:] if m_local == m_max else None
    if mine_a is not None and float(mine_a.norm()) > 0:
        for r in with_sampler:
            diff = float((applied_all[r][0, 1:] - mine_a).norm()) / float(mine_a.norm())
            differ = max(differ, diff)
    counts = tuple(float(v) for r in rows for v in r[:, 0].tolist())
    result = _NO_FIT
    if mine_a is not None and k_total > 0 and m_max > 0:
        samples = torch.cat([r[:, 1:] for r in rows if r.shape[1] == m_max + 1 and r.shape[0]])
        left = sum(leftover_all[r][0, 1:] for r in with_sampler) / max(len(with_sampler), 1)
        result = fit(
            samples, left if isinstance(left, torch.Tensor) else None, mine_a / coef, count
        )

    problem, pattern = None, "nothing to check"
    if any(math.isnan(c.coef) for c in clips):
        problem, pattern = (
            (
                "clip_grad_value_ clipped the gradient entry by entry, which no full-batch "
                "gradient equals: probe a run without it"
            ),
            "unsupported",
        )
    elif k_total == 0:
        problem = (
            "nothing to check: no micro-batch ran a module this optimizer trains since its last "
            "step (the model ran without gradients, or the engine runs it outside nn.Module "
            "calls)"
        )
    elif count == 0:
        problem = (
            f"nothing to check: the window's {k_total} micro-batches hold no counted items "
            f"under the {name} objective (every label ignored?)"
        )
    elif applied_norm == 0:
        problem, pattern = (
            (
                f"dropped: no gradient reached the optimizer's parameters at step() (zero or "
                f"missing .grad) although {k_total} micro-batches ran; an engine that keeps "
                "gradients outside .grad (DeepSpeed ZeRO, ColossalAI ZeRO/Gemini) cannot be probed"
            ),
            "dropped",
        )
    ok = problem is None and ref_norm > 0 and error <= tol and differ <= tol
    clipped = [c for c in clips if c.coef < 1.0]  # a clip_grad_norm_ that only measured: none
    last = clipped[-1] if clipped else None
    return Measured(
        step=step, engine=engine, objective=name, ok=ok, error=error, band=band,
        tolerance=tol, ranks=per_rank, counts=counts, count=count, fit=result,
        ranks_differ=differ, clip=None if last is None else (last.max_norm, last.total_norm),
        problem=problem, problem_pattern=pattern,
    )  # fmt: skip

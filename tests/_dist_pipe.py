"""Rank functions for pipeline parallelism: DP x PP = 2 x 2 on 4 gloo ranks, one group.

Ranks: stage rank ``s = rank % 2`` (pipeline groups {0, 1}, {2, 3}), data-parallel index
``d = rank // 2`` (DP groups {0, 2}, {1, 3}). DP index 0 runs two ``schedule.step`` calls per
optimizer step and DP index 1 one (uneven ranks). Each rank returns its stages' parameters
after every step, by global layer index; the parent assembles and compares.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import fullbatch as fb
from _dist_cases import IN, OUT, make_optimizer

HIDDEN = 16
ROWS, MICRO = 8, 4  # rows per schedule step, pipeline micro-batches per schedule step
CALLS = [2, 1]  # schedule steps per window, per DP index
WINDOWS = 2


def make_blocks(seed: int = 0) -> list[nn.Module]:
    """Four blocks; stages take 2 each (GPipe, 1F1B) or 1 each (interleaved, 2 per rank)."""
    torch.manual_seed(seed)
    return [
        nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh()).double(),
        nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()).double(),
        nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()).double(),
        nn.Linear(HIDDEN, OUT).double(),
    ]


def batch(d: int, window: int, call: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(31 * d + 7 * window + call)
    x = torch.randn(ROWS, IN, generator=g, dtype=torch.float64)
    y = torch.randint(0, OUT, (ROWS,), generator=g)
    y[torch.rand(ROWS, generator=g) < 0.3] = -100
    if d == 1 and window == 1:
        y[: ROWS // 2] = -100  # whole pipeline micro-batches with no counted item
    return x, y


def mean_ce(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, target, ignore_index=-100)


def _count_all_reduce(calls: Counter[str], groups: dict[str, Any]) -> Any:
    real = dist.all_reduce

    def call(*args: Any, **kwargs: Any) -> Any:
        group = kwargs.get("group")
        name = "world" if group in (None, dist.group.WORLD) else "other"
        name = next((k for k, g in groups.items() if g == group), name)
        calls[f"ar:{name}"] += 1
        return real(*args, **kwargs)

    dist.all_reduce = call
    return real


def _run(rank: int, kind: str, pp: Any, dp: Any, mode: str) -> dict[str, Any]:
    from torch.distributed import pipelining as pl

    s, d = rank % 2, rank // 2
    blocks = make_blocks()
    if kind == "interleaved":
        ids = [s, s + 2]  # loop placement: rank s holds stages s and s + 2
        stages = [pl.PipelineStage(blocks[i], i, 4, torch.device("cpu"), group=pp) for i in ids]
    else:
        ids = [2 * s, 2 * s + 1]
        module = nn.Sequential(blocks[ids[0]], blocks[ids[1]])
        stages = [pl.PipelineStage(module, s, 2, torch.device("cpu"), group=pp)]
    params = [p for i in ids for p in blocks[i].parameters()]
    opt = make_optimizer(params)
    if mode == "naive":  # a mean loss per micro-batch, torch's default scale_grads=True
        loss_fn: Any = mean_ce
    else:
        loss_fn = fb.PipelineLoss(fb.cross_entropy_sum)
    cls = {
        "gpipe": pl.ScheduleGPipe,
        "1f1b": pl.Schedule1F1B,
        "interleaved": pl.ScheduleInterleaved1F1B,
    }[kind]
    first, last = s == 0, s == 1
    schedule = cls(
        stages if kind == "interleaved" else stages[0],
        n_microbatches=MICRO,
        loss_fn=loss_fn,
        scale_grads=mode == "naive",
    )
    out: dict[str, Any] = {"params": [], "stats": [], "counts": []}
    calls: Counter[str] = Counter()
    real = _count_all_reduce(calls, {"dp": dp, "pp": pp})
    try:
        if mode == "naive":
            for w in range(WINDOWS):
                for c in range(CALLS[d]):
                    x, y = batch(d, w, c)
                    schedule.step(x if first else None, target=y if last else None)
                for p in params:  # DP: average, as DDP would
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    real(p.grad, group=dp)
                    p.grad.div_(2)
                opt.step()
                opt.zero_grad(set_to_none=True)
                out["params"].append({i: _flat(blocks[i]) for i in ids})
            return out
        scaler = None
        order = list(range(WINDOWS))
        if mode == "scaler":  # window 0's data once more first, with an inf forced on rank 0
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
            order = [0, *order]
            out["scale"] = []
        pipe = fb.Pipeline(schedule, opt, dp_group=dp, max_grad_norm=0.5, scaler=scaler)
        for n, w in enumerate(order):
            data = [batch(d, w, c) for c in range(CALLS[d])]
            window = pipe.window([y for _, y in data] if last else None)
            inf = None
            if scaler is not None and n == 0 and rank == 0:  # stage 0 of DP index 0 only
                inf = blocks[0][0].weight.register_hook(lambda g: torch.full_like(g, math.inf))
            for x, y in data:
                window.run(x if first else None, target=y if last else None)
            if inf is not None:
                inf.remove()
            out["held"] = sum(p.grad.numel() * 8 for p in params if p.grad is not None)
            before = [p.detach().clone() for p in params]
            grads = [None if p.grad is None else float(p.grad.norm()) for p in params]
            out["stats"].append(window.step())
            if n == 0:  # diagnostics for a failure: did the step move this rank's parameters?
                moved = [not torch.equal(b, p) for b, p in zip(before, params, strict=True)]
                mine = [q for i in ids for q in blocks[i].parameters()]
                same = all(a is b for a, b in zip(mine, params, strict=True))
                out["diag"] = {"grads": grads, "moved": moved, "same": same}
            out["counts"].append(dict(calls))
            calls.clear()
            out["params"].append({i: _flat(blocks[i]) for i in ids})
            if scaler is not None:
                out["scale"].append(scaler.get_scale())
        if scaler is not None:  # the skipped window: parameters as built; compare the rest
            out["skipped_params"] = out["params"].pop(0)
            out["skipped_stats"] = out["stats"].pop(0)
            out["counts"].pop(0)
    finally:
        dist.all_reduce = real
    return out


def _flat(block: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in block.parameters()])


def _refusals() -> dict[str, str]:
    from torch.distributed import pipelining as pl

    errors = {}
    # A one-stage pipeline on this rank (every rank creates every group, in the same order).
    group = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
    block = make_blocks()[3]
    opt = make_optimizer(block.parameters())
    before = _flat(block)
    for name, loss_fn, scale in [
        ("scale_grads", fb.PipelineLoss(fb.cross_entropy_sum), True),
        ("mean_loss", mean_ce, False),
    ]:
        stage = pl.PipelineStage(block, 0, 1, torch.device("cpu"), group=group)
        schedule = pl.ScheduleGPipe(stage, n_microbatches=2, loss_fn=loss_fn, scale_grads=scale)
        try:
            fb.Pipeline(schedule, opt)
        except ValueError as exc:
            errors[name] = str(exc)
    stage = pl.PipelineStage(block, 0, 1, torch.device("cpu"), group=group)
    loss = fb.PipelineLoss(fb.cross_entropy_sum)
    schedule = pl.ScheduleGPipe(stage, n_microbatches=2, loss_fn=loss, scale_grads=False)
    try:
        fb.Pipeline(schedule, opt, scaler=object())  # not a GradScaler
    except TypeError as exc:
        errors["scaler"] = str(exc)
    assert torch.equal(before, _flat(block)) and all(p.grad is None for p in block.parameters())
    return errors


def pipe_cases(rank: int, world: int) -> dict[str, Any]:
    pp = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    dp = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    results: dict[str, Any] = {}
    for kind in ("gpipe", "1f1b", "interleaved"):
        results[kind] = _run(rank, kind, pp, dp, "fullbatch")
    results["naive-1f1b"] = _run(rank, "1f1b", pp, dp, "naive")
    results["scaler-1f1b"] = _run(rank, "1f1b", pp, dp, "scaler")
    results["refusals"] = _refusals()
    return results


def pipe_reference(max_grad_norm: float = 0.5) -> dict[str, list[Any]]:
    """The whole model on every DP index's window data at once, float64, token mean."""
    blocks = make_blocks()
    model = nn.Sequential(*blocks)
    opt = make_optimizer(model.parameters())
    out: dict[str, list[Any]] = {"params": [], "norms": [], "counts": [], "losses": []}
    for w in range(WINDOWS):
        data = [batch(d, w, c) for d in range(2) for c in range(CALLS[d])]
        x = torch.cat([b[0] for b in data])
        y = torch.cat([b[1] for b in data])
        n = int((y != -100).sum())
        loss = nn.functional.cross_entropy(model(x), y, reduction="sum") / n
        opt.zero_grad()
        loss.backward()
        out["norms"].append(float(nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)))
        out["counts"].append(float(n))
        out["losses"].append(float(loss.detach()))
        opt.step()
        out["params"].append([_flat(b) for b in blocks])
    return out

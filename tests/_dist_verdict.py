"""Rank functions for the one-verdict pipeline case: PP = 2 on 2 gloo ranks, no data parallelism.

Three windows of one GPipe ``schedule.step`` each (8 rows, 4 pipeline micro-batches); the middle
window is poisoned: a NaN in one row's input (a NaN loss on the last stage), or an inf forced
into stage 0's gradient (a finite loss, a non-finite gradient on one stage only). Each rank
returns a :class:`conftest.Snapshot` of its stage (parameters, optimizer and scheduler state)
after every window, its counters, the reasons, and the warnings it raised.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import nn

import fullbatch as fb
from _dist_cases import IN, OUT
from _dist_pipe import make_blocks
from conftest import Snapshot

ROWS, MICRO, WINDOWS = 8, 4, 3
MODES = ("nan_loss", "inf_grad")


def batch(window: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11 + window)
    x = torch.randn(ROWS, IN, generator=g, dtype=torch.float64)
    y = torch.randint(0, OUT, (ROWS,), generator=g)
    y[torch.rand(ROWS, generator=g) < 0.3] = -100
    return x, y


def optimizer_and_schedule(params: Any) -> tuple[Any, Any]:
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))


def _run(rank: int, mode: str) -> dict[str, Any]:
    from torch.distributed import pipelining as pl

    blocks = make_blocks()
    stage_module = nn.Sequential(blocks[2 * rank], blocks[2 * rank + 1])
    stage = pl.PipelineStage(stage_module, rank, 2, torch.device("cpu"))
    schedule = pl.ScheduleGPipe(
        stage,
        n_microbatches=MICRO,
        loss_fn=fb.PipelineLoss(fb.cross_entropy_sum),
        scale_grads=False,
    )
    opt, sched = optimizer_and_schedule(stage_module.parameters())
    pipe = fb.Pipeline(schedule, opt, max_grad_norm=1.0, scheduler=sched)
    first, last = rank == 0, rank == 1
    out: dict[str, Any] = {"snaps": [], "reasons": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for w in range(WINDOWS):
            x, y = batch(w)
            hook = None
            if w == 1 and mode == "nan_loss":
                x = x.clone()
                x[5, 0] = math.nan  # pipeline micro-batch 2 of 4
            if w == 1 and mode == "inf_grad" and first:
                weight = blocks[0][0].weight
                hook = weight.register_hook(lambda g: torch.full_like(g, math.inf))
            window = pipe.window([y] if last else None)
            window.run(x if first else None, target=y if last else None)
            if hook is not None:
                hook.remove()
            stats = window.step()
            out["reasons"].append(stats.reason)
            out["snaps"].append(Snapshot.take(stage_module, opt, sched))
    out["steps"], out["skipped"] = pipe.steps, pipe.skipped_windows
    out["stats_counters"] = (stats.steps, stats.skipped_windows)
    out["warnings"] = [
        (str(w.message), w.category.__name__, w.filename)
        for w in caught
        if "was skipped" in str(w.message)
    ]
    return out


def verdict_cases(rank: int, world: int) -> dict[str, Any]:
    return {mode: _run(rank, mode) for mode in MODES}


def reference() -> list[list[torch.Tensor]]:
    """The whole model on windows 0 and 2 (the poisoned one left out), float64, token mean:
    the parameters of each block after each of the two steps."""
    blocks = make_blocks()
    model = nn.Sequential(*blocks)
    opt, sched = optimizer_and_schedule(model.parameters())
    out = []
    for w in (0, 2):
        x, y = batch(w)
        loss = nn.functional.cross_entropy(model(x), y, reduction="sum") / int((y != -100).sum())
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        out.append([p.detach().clone() for p in model.parameters()])
    return out

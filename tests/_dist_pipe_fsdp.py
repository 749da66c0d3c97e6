"""Rank functions for pipeline x FSDP2: a ("dp", "pp") = 2 x 2 mesh on 4 gloo ranks, one group.

Stage ``s = rank % 2`` holds blocks ``2s, 2s + 1`` ``fully_shard``'ed over "dp"; data-parallel
index ``d = rank // 2`` reads its own items (uneven labelled counts: index 1's second window
has whole pipeline micro-batches without a counted item). FSDP2 reduce-scatters each stage's
gradients (averaged over "dp"); fullbatch counts on the last stages, undoes the average and
clips by the norm over every stage and shard. Each rank returns its stage's full parameters
after every step; the parent assembles them and compares with :func:`reference`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import fullbatch as fb
from _dist_cases import _full_params, make_optimizer
from _dist_pipe import MICRO, batch, make_blocks

WINDOWS = 2
CLIP = 0.5
SCHEDULES = ("gpipe", "1f1b")


def _run(rank: int, mesh: Any, kind: str) -> dict[str, Any]:
    from torch.distributed import pipelining as pl
    from torch.distributed.fsdp import fully_shard

    s, d = rank % 2, rank // 2
    blocks = make_blocks()
    module = fully_shard(nn.Sequential(blocks[2 * s], blocks[2 * s + 1]), mesh=mesh["dp"])
    stage = pl.PipelineStage(module, s, 2, torch.device("cpu"), group=mesh.get_group("pp"))
    cls = {"gpipe": pl.ScheduleGPipe, "1f1b": pl.Schedule1F1B}[kind]
    loss = fb.PipelineLoss(fb.cross_entropy_sum)
    schedule = cls(stage, n_microbatches=MICRO, loss_fn=loss, scale_grads=False)
    opt = make_optimizer(module.parameters())
    pipe = fb.Pipeline(schedule, opt, max_grad_norm=CLIP)
    first, last = s == 0, s == 1
    out: dict[str, Any] = {"params": [], "stats": []}
    for w in range(WINDOWS):
        x, y = batch(d, w, 0)
        window = pipe.window([y] if last else None)
        window.run(x if first else None, target=y if last else None)
        out["stats"].append(window.step())
        out["params"].append(_full_params(module))
    return out


def _refused(rank: int, mesh: Any) -> str:
    from torch.distributed import pipelining as pl
    from torch.distributed.fsdp import fully_shard

    s = rank % 2
    blocks = make_blocks()
    module = fully_shard(nn.Sequential(blocks[2 * s], blocks[2 * s + 1]), mesh=mesh["dp"])
    stage = pl.PipelineStage(module, s, 2, torch.device("cpu"), group=mesh.get_group("pp"))
    loss = fb.PipelineLoss(fb.cross_entropy_sum)
    schedule = pl.ScheduleGPipe(stage, n_microbatches=MICRO, loss_fn=loss, scale_grads=False)
    try:
        fb.Pipeline(schedule, make_optimizer(module.parameters()), dp_group=mesh.get_group("dp"))
    except ValueError as exc:
        return str(exc)
    return "not refused"


def pipe_fsdp_cases(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    out: dict[str, Any] = {kind: _run(rank, mesh, kind) for kind in SCHEDULES}
    out["dp_group"] = _refused(rank, mesh)
    return out


def reference() -> dict[str, list[Any]]:
    """The whole model on both data-parallel indices' windows, float64, clipped."""
    blocks = make_blocks()
    model = nn.Sequential(*blocks)
    opt = make_optimizer(model.parameters())
    out: dict[str, list[Any]] = {"params": [], "norms": [], "counts": []}
    for w in range(WINDOWS):
        data = [batch(d, w, 0) for d in range(2)]
        x, y = torch.cat([b[0] for b in data]), torch.cat([b[1] for b in data])
        n = int((y != -100).sum())
        opt.zero_grad()
        (nn.functional.cross_entropy(model(x), y, reduction="sum") / n).backward()
        out["norms"].append(float(nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        out["counts"].append(float(n))
        opt.step()
        out["params"].append(
            [torch.cat([p.detach().reshape(-1) for p in b.parameters()]) for b in blocks]
        )
    return out

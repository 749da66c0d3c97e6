"""Rank functions for the probe on tensor parallelism (tests/probe/test_probe_tp.py).

Meshes: TP alone on a 1-D "tp" mesh (2 ranks, both run the same micro-batches); FSDP2 over
"dp" x TP over "tp" (2 x 2, 4 ranks); HSDP x TP over ("replicate", "shard", "tp") = (2, 1, 2)
(4 ranks: FSDP2's 2-D data mesh, its shard dim of one rank). The model (``make_model3``) has
its first Linear column-wise and its second row-wise parallel (``parallelize_module``), its
last one plain (replicated on the tensor-parallel ranks, FSDP2-sharded over the data dims).

Every case trains ``WINDOWS`` windows of ``K`` micro-batches under ``fb.probe(windows=2)``
(the run goes on), a right loop also plain from the same start, and returns the full
parameters after every step, the first applied gradient (gathered whole) and the report.

Loops, written by hand (FSDP2's own division turned off, ``set_gradient_divide_factor(1)``,
as torchtitan does): ``"right"`` each micro-batch's loss sum over the window's item count
all-reduced over the data ranks; ``"mean/K"`` a per-micro-batch mean over ``K``;
``"rank count"`` the loss sum over this rank's own count; ``"count over tp"`` the count
all-reduced over every rank (the tensor-parallel ranks' copies counted too).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import fullbatch as fb
from _dist_cases import _full_params, make_optimizer, micro_batch
from _dist_scale import make_model3

K = 3
WINDOWS = 3
#: Rows of each data rank's micro-batches (K per window, WINDOWS windows).
LAYOUT = [
    [3, 1, 4, 2, 5, 2, 3, 1, 2],
    [2, 6, 1, 3, 2, 2, 4, 1, 3],
]
LOOPS = ("right", "mean/K", "rank count", "count over tp")


def objective(model: nn.Module, micro: dict[str, torch.Tensor]) -> tuple[Any, Any]:
    return fb.cross_entropy_sum(model(micro["x"]), micro["y"])


def counted(micro: dict[str, torch.Tensor]) -> int:
    return int((micro["y"] != -100).sum())


def windows_of(data_rank: int) -> list[list[dict[str, torch.Tensor]]]:
    data = [micro_batch(data_rank, i, rows) for i, rows in enumerate(LAYOUT[data_rank])]
    return [data[w * K : (w + 1) * K] for w in range(WINDOWS)]


def _model(tp: Any, dp: Any) -> nn.Module:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    model = make_model3()
    parallelize_module(model, tp, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    if dp is None:
        return model
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
    for module in model.modules():  # the loop divides by the global count itself
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)  # per module: it does not recurse
    return model


def _loop(model: nn.Module, opt: Any, data_rank: int, dp_group: Any, how: str) -> list[Any]:
    out = []
    for window in windows_of(data_rank):
        mine = torch.tensor(float(sum(counted(m) for m in window)), dtype=torch.float64)
        n = mine.clone()
        if how == "count over tp":
            dist.all_reduce(n)  # every rank: the tensor-parallel copies counted too
        elif how != "rank count" and dp_group is not None:
            dist.all_reduce(n, group=dp_group)
        for micro in window:
            if how == "mean/K":
                logits = model(micro["x"])
                (nn.functional.cross_entropy(logits, micro["y"]) / K).backward()
            else:
                loss_sum, _ = objective(model, micro)
                (loss_sum / (mine if how == "rank count" else n)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(_full_params(model))
    return out


def _record(into: list[Any], model: nn.Module, *hook_args: Any) -> None:
    if not into:
        into.append([_whole(p.grad) for p in model.parameters()])


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _replicas(tp: Any, data_rank: int, dp_group: Any, ranks: Any) -> dict[str, Any]:
    """TP over "tp" beside a data dim the loop averages itself (no FSDP2, no DDP): the right
    loop's gradients summed over ``dp_group`` by hand, probed with ``ranks`` (None: the probe
    cannot tell the data ranks and says so)."""
    model = _model(tp, None)
    opt = make_optimizer(model.parameters())
    applied: list[Any] = []
    opt.register_step_pre_hook(functools.partial(_record, applied, model))
    with fb.probe(objective=objective, windows=1, ranks=ranks) as probe:
        window = windows_of(data_rank)[0]
        n = torch.tensor(float(sum(counted(m) for m in window)), dtype=torch.float64)
        dist.all_reduce(n, group=dp_group)
        for micro in window:
            loss_sum, _ = objective(model, micro)
            (loss_sum / n).backward()
        for p in model.parameters():  # the data dim's sum, by hand, shard by shard
            local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            dist.all_reduce(local, group=dp_group)
        opt.step()
    return {"applied": applied, "report": probe.report}


def _case(tp: Any, dp: Any, data_rank: int, dp_group: Any, how: str) -> dict[str, Any]:
    """The probed run; for a right loop, the plain run first (the parent compares them
    bitwise). The applied gradient is recorded at the first step (the probe touches no
    ``.grad``)."""
    runs: dict[str, Any] = {"applied": []}
    for probed in (False, True) if how.endswith("right") else (True,):
        model = _model(tp, dp)
        opt = make_optimizer(model.parameters())
        if not runs["applied"]:
            opt.register_step_pre_hook(functools.partial(_record, runs["applied"], model))
        with fb.probe(objective=objective, windows=2) if probed else _Nothing() as probe:
            runs["probed" if probed else "plain"] = _loop(model, opt, data_rank, dp_group, how)
        if probed:
            runs["report"] = probe.report
    return runs


def tp_alone(rank: int, world: int) -> dict[str, Any]:
    """Tensor parallelism alone over every rank: one data rank."""
    from torch.distributed.device_mesh import init_device_mesh

    tp = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    loops = ("right", "mean/K", "count over tp")
    return {how: _case(tp, None, 0, None, how) for how in loops}


def fsdp_tp(rank: int, world: int) -> dict[str, Any]:
    """FSDP2 over "dp" x TP over "tp" (2 x 2), then HSDP x TP over (2, 1, 2): every loop on
    the first, the right one on the second; then TP beside a data dim the loop sums by hand,
    probed without and with ``ranks=`` the data group."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    data_rank = mesh.get_local_rank("dp")
    out = {how: _case(mesh["tp"], mesh["dp"], data_rank, mesh.get_group("dp"), how)
           for how in LOOPS}  # fmt: skip
    hsdp = init_device_mesh("cpu", (2, 1, world // 2), mesh_dim_names=("rep", "shard", "tp"))
    data = hsdp["rep", "shard"]
    group = data._flatten().get_group()
    out["hsdp right"] = _case(hsdp["tp"], data, hsdp.get_local_rank("rep"), group, "right")
    dp_group = mesh.get_group("dp")
    out["beside"] = _replicas(mesh["tp"], data_rank, dp_group, None)
    out["ranks= right"] = _replicas(mesh["tp"], data_rank, dp_group, dp_group)
    return out


def reference(data_ranks: int) -> list[list[torch.Tensor]]:
    """Each window's full gradient (float64, the mean over every data rank's counted rows),
    from the run's parameters before that window's step, as a plain full-batch model."""
    model = make_model3()
    opt = make_optimizer(model.parameters())
    windows = [windows_of(r) for r in range(data_ranks)]
    out = []
    for w in range(WINDOWS):
        micros = [m for r in range(data_ranks) for m in windows[r][w]]
        x = torch.cat([m["x"] for m in micros])
        y = torch.cat([m["y"] for m in micros])
        nn.functional.cross_entropy(model(x), y).backward()
        out.append([p.grad.detach().clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out

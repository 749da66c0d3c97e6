"""Rank functions for the probe on FSDP2 and HSDP (tests/probe/test_probe_fsdp.py).

Every case trains ``WINDOWS`` windows of ``K`` micro-batches twice from the same start, once
plain and once under ``fb.probe(windows=2)`` (``--keep-training``: the run goes on after the
probed windows), and returns both runs' full parameters after every step and the probe's
report: the parent asserts the verdicts on every rank and that the probed run's parameters
are bitwise the plain run's.

Loops: ``"right"`` (each micro-batch's loss sum times ``world / N``, ``N`` the window's item
count over every micro-batch and rank, all-reduced up front: FSDP2 averages over the ranks),
``"mean/K"`` (a per-micro-batch mean over ``K``: the mean of per-micro-batch means with
uneven counts), and fullbatch's own route (``fb.Accumulator`` on the ``fully_shard`` model, with
its FSDP2/HSDP sync modes). Row counts differ per micro-batch and rank; about a quarter of the
labels are ignored.
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
#: Rows of each rank's micro-batches (K per window, WINDOWS windows), up to 4 ranks.
LAYOUT = [
    [3, 1, 4, 2, 5, 2, 3, 1, 2],
    [2, 6, 1, 3, 2, 2, 4, 1, 3],
    [1, 2, 3, 4, 4, 1, 2, 2, 1],
    [4, 1, 2, 2, 3, 5, 1, 3, 2],
]


def objective(model: nn.Module, micro: dict[str, torch.Tensor]) -> tuple[Any, Any]:
    return fb.cross_entropy_sum(model(micro["x"]), micro["y"])


def counted(micro: dict[str, torch.Tensor]) -> int:
    return int((micro["y"] != -100).sum())


def _sharded(mesh: Any, per_layer: bool) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = make_model3()
    if per_layer:
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _windows(rank: int) -> list[list[dict[str, torch.Tensor]]]:
    data = [micro_batch(rank, i, rows) for i, rows in enumerate(LAYOUT[rank])]
    return [data[w * K : (w + 1) * K] for w in range(WINDOWS)]


def _loop(model: nn.Module, opt: Any, rank: int, world: int, how: str) -> list[torch.Tensor]:
    out = []
    for window in _windows(rank):
        n = torch.tensor(float(sum(counted(m) for m in window)), dtype=torch.float64)
        dist.all_reduce(n)
        for micro in window:
            if how == "right":
                loss_sum, _ = objective(model, micro)
                (loss_sum * world / n).backward()
            else:  # "mean/K"
                logits = model(micro["x"])
                (nn.functional.cross_entropy(logits, micro["y"]) / K).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(_full_params(model))
    return out


def _route(model: nn.Module, opt: Any, rank: int, sync: str | None) -> list[torch.Tensor]:
    out = []
    data = [m for w in _windows(rank) for m in w]
    options = {} if sync is None else {"fsdp_sync": sync}
    with fb.Accumulator(model, opt, micro_batches=K, **options) as acc:
        for window in acc.windows(data):
            for micro in window:
                window.backward(*objective(model, micro))
            window.step()
            out.append(_full_params(model))
    return out


def _case(rank: int, world: int, mesh: Any, per_layer: bool, how: str) -> dict[str, Any]:
    """``how``: ``"right"``, ``"mean/K"`` or ``"route"``/``"route:<fsdp_sync>"``."""
    runs: dict[str, Any] = {"applied": []}
    for probed in (False, True):
        model = _sharded(mesh, per_layer)
        opt = make_optimizer(model.parameters())
        if not probed:  # the plain run's first applied gradient, gathered whole
            opt.register_step_pre_hook(functools.partial(_record, runs["applied"], model))
        with fb.probe(objective=objective, windows=2) if probed else _Nothing() as probe:
            if how.startswith("route"):
                sync = how.partition(":")[2] or None
                params = _route(model, opt, rank, sync)
            else:
                params = _loop(model, opt, rank, world, how)
        runs["probed" if probed else "plain"] = params
        if probed:
            runs["report"] = probe.report
    return runs


def _record(into: list[Any], model: nn.Module, *hook_args: Any) -> None:
    if not into:
        into.append([p.grad.full_tensor() for p in model.parameters()])


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def fsdp_1d(rank: int, world: int) -> dict[str, Any]:
    """FSDP2 over a 1-D mesh of every rank: plain loops and fullbatch's route."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    return {
        "right": _case(rank, world, mesh, True, "right"),
        "mean/K": _case(rank, world, mesh, True, "mean/K"),
        "route": _case(rank, world, mesh, False, "route"),
    }


def hsdp_2d(rank: int, world: int) -> dict[str, Any]:
    """HSDP over a 2 x 2 (replicate, shard) mesh: plain loops and fullbatch's three syncs."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    out = {how: _case(rank, world, mesh, True, how) for how in ("right", "mean/K")}
    for sync in ("hybrid", "window", "micro_batch"):
        out[f"route:{sync}"] = _case(rank, world, mesh, True, f"route:{sync}")
    return out


def reference(world: int) -> list[list[torch.Tensor]]:
    """Each window's full gradient (float64, the mean over every rank's counted rows) from
    the run's parameters before that window's step, as a plain full-batch PyTorch model."""
    model = make_model3()
    opt = make_optimizer(model.parameters())
    windows = [_windows(r) for r in range(world)]
    out = []
    for w in range(WINDOWS):
        micros = [m for r in range(world) for m in windows[r][w]]
        x = torch.cat([m["x"] for m in micros])
        y = torch.cat([m["y"] for m in micros])
        nn.functional.cross_entropy(model(x), y).backward()
        out.append([p.grad.detach().clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out

"""Rank functions for composed meshes: tensor parallelism alone (2 ranks), FSDP2 x TP on a
2 x 2 ("dp", "tp") mesh and HSDP x TP on a 2 x 1 x 2 ("rep", "shard", "tp") mesh (4 ranks),
every case of a world in ONE process group.

The model is ``make_model`` (Linear, Tanh, Linear) with ColwiseParallel on the first Linear
and RowwiseParallel on the second, whose bias stays replicated over "tp": the norm must count
it once. Ranks of one "tp" group read the same micro-batches; the "dp" ranks read different
numbers of rows and micro-batches (uneven). Each case returns the full parameters and
StepStats after every step and fullbatch's collectives per window; the parent builds the
float64 full-batch reference (:func:`reference`) and asserts.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

import fullbatch as fb
from _dist_cases import _full_params, make_model, micro_batch
from _dist_count import _Counter

K = 3  # micro-batches per window and data-parallel rank
# Rows of each micro-batch, per data-parallel index: index 1 runs out (padding under FSDP2).
DP_LAYOUT = [[3, 1, 4, 2, 5, 2, 3], [2, 6, 1, 3]]
# name -> (optimizer, Accumulator options)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "sgd": ("sgd", {}),
    "sgd-clip": ("sgd", {"max_grad_norm": 0.2}),  # bites on every step
    "adamw-clip": ("adamw", {"max_grad_norm": 0.2}),
}
FSDP_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    **CASES,
    "micro_batch-clip": ("sgd", {"max_grad_norm": 0.2, "fsdp_sync": "micro_batch"}),
    "named-clip": ("sgd", {"max_grad_norm": 0.2, "data_mesh_dims": ("dp",)}),
}

HSDP_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "hsdp-hybrid-clip": ("sgd", {"max_grad_norm": 0.2}),
    "hsdp-window-adamw-clip": ("adamw", {"max_grad_norm": 0.2, "fsdp_sync": "window"}),
}


def make_optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def data_for(dp_index: int) -> list[dict[str, torch.Tensor]]:
    return [micro_batch(dp_index, i, rows) for i, rows in enumerate(DP_LAYOUT[dp_index])]


def reference(opt_kind: str, max_grad_norm: float | None, dp: int) -> dict[str, list[Any]]:
    """Plain PyTorch, float64, full batch over the ``dp`` data-parallel indices' items:
    flat parameters, the unclipped norm and the item count after every step."""
    model = make_model()
    opt = make_optimizer(opt_kind, model.parameters())
    data = [data_for(d) for d in range(dp)]
    windows = max((len(d) + K - 1) // K for d in data)
    out: dict[str, list[Any]] = {"params": [], "norms": [], "counts": []}
    for w in range(windows):
        micro = [m for d in data for m in d[w * K : (w + 1) * K]]
        x = torch.cat([m["x"] for m in micro])
        y = torch.cat([m["y"] for m in micro])
        n = int((y != -100).sum())
        loss = nn.functional.cross_entropy(model(x), y, ignore_index=-100, reduction="sum") / n
        opt.zero_grad()
        loss.backward()
        norm = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm()
        if max_grad_norm is not None:
            nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        out["params"].append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        out["norms"].append(float(norm))
        out["counts"].append(float(n))
    return out


def _tp(model: nn.Module, tp_mesh: Any) -> nn.Module:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    return parallelize_module(model, tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def _train(
    model: nn.Module, opt_kind: str, options: dict[str, Any], data: list[Any], groups: Any
) -> dict[str, Any]:
    opt = make_optimizer(opt_kind, model.parameters())
    out: dict[str, Any] = {"params": [], "stats": [], "counts": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc = fb.Accumulator(model, opt, micro_batches=K, **options)
    out["warnings"] = [str(w.message) for w in caught if "view tensor" not in str(w.message)]
    out["divisor"] = acc._engine.sync.divisor
    with acc, _Counter(groups) as counter:
        for window in acc.windows(data):
            for micro in window:
                loss_sum, n = fb.cross_entropy_sum(model(micro["x"]), micro["y"])
                window.backward(loss_sum, n)
            out["stats"].append(window.step())
            out["counts"].append(counter.take())
            out["params"].append(_full_params(model))
    return out


def _refused(build: Any) -> str:
    try:
        build()
    except ValueError as exc:
        return str(exc)
    return "not refused"


def tp_cases(rank: int, world: int) -> dict[str, Any]:
    """Tensor parallelism alone over every rank: both ranks read the same micro-batches."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out: dict[str, Any] = {}
    for name, (opt_kind, options) in CASES.items():
        out[name] = _train(_tp(make_model(), mesh), opt_kind, options, data_for(0), {})
    model = _tp(make_model(), mesh)
    opt = make_optimizer("sgd", model.parameters())
    out["named-wrong"] = _refused(
        lambda: fb.Accumulator(model, opt, micro_batches=K, data_mesh_dims=("tp",))
    )
    return out


def fsdp_tp_cases(rank: int, world: int) -> dict[str, Any]:
    """FSDP2 on "dp" x TP on "tp" (2 x 2): dp index ``rank // 2`` reads its own items."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    groups = {"dp": mesh.get_group("dp"), "tp": mesh.get_group("tp")}
    data = data_for(rank // 2)
    out: dict[str, Any] = {}
    for name, (opt_kind, options) in FSDP_CASES.items():
        model = fully_shard(_tp(make_model(), mesh["tp"]), mesh=mesh["dp"])
        out[name] = _train(model, opt_kind, options, data, groups)
    model = fully_shard(_tp(make_model(), mesh["tp"]), mesh=mesh["dp"])
    opt = make_optimizer("sgd", model.parameters())
    out["named-wrong"] = _refused(
        lambda: fb.Accumulator(model, opt, micro_batches=K, data_mesh_dims=("tp",))
    )
    # HSDP x TP: replicate over "rep" (the data index), one shard, TP on "tp". The parameters
    # are 3-D DTensors replicated over "rep": each replica adds half its squared norm.
    mesh3 = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("rep", "shard", "tp"))
    groups3 = {"rep": mesh3.get_group("rep"), "tp": mesh3.get_group("tp")}
    for name, (opt_kind, options) in HSDP_CASES.items():
        model = fully_shard(_tp(make_model(), mesh3["tp"]), mesh=mesh3["rep", "shard"])
        out[name] = _train(model, opt_kind, options, data, groups3)
    return out

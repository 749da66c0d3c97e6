"""Rank functions for HSDP (2 x 2 mesh) and context parallelism (2 DP x 2 CP) on 4 ranks.

Every case runs in ONE 4-process group (``scale_cases``) and returns plain data: full
parameters and StepStats after every step, collectives counted per window by wrapping the
``torch.distributed`` functions FSDP2 and fullbatch call, and the gradient memory held
between micro-batches. The parent builds the float64 full-batch references and asserts.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import fullbatch as fb
from _dist_cases import IN, OUT, _full_params, make_optimizer, micro_batch
from _dist_count import _Counter, _held_grad_bytes
from _dist_hsdp_resume import hsdp_resume

HIDDEN = 16
K = 4
# Per rank: row counts of its micro-batches; rank 3 runs out (padding micro-batches).
HSDP_LAYOUT = [
    [3, 1, 4, 2, 5, 2, 3, 1, 2, 4],
    [2, 6, 1, 3, 2, 2, 4, 1, 3, 2],
    [1, 2, 3, 4, 4, 1, 2, 2, 1, 3],
    [4, 1, 2, 2, 3, 5, 1],
]
# name -> Accumulator options (and "divide": a set_gradient_divide_factor value)
HSDP_CASES: dict[str, dict[str, Any]] = {
    "hybrid": {"max_grad_norm": 0.3},  # the 2-D default
    "window": {"fsdp_sync": "window", "hook": True},
    "micro_batch": {"fsdp_sync": "micro_batch"},
    "hybrid-divide-1": {"fsdp_sync": "hybrid", "divide": 1.0},
}
T = 6  # sequence length; each CP rank holds half
CP_LAYOUT = [[2, 3, 1, 2, 3], [3, 1, 2]]  # per data-parallel index: rows of its micro-batches


def make_model3(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(IN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, OUT),
    ).double()


def _hsdp(model: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _hsdp_case(rank: int, mesh: Any, options: dict[str, Any]) -> dict[str, Any]:
    options = dict(options)
    divide = options.pop("divide", None)
    hook = options.pop("hook", False)
    model = _hsdp(make_model3(), mesh)
    if divide is not None:
        for m in model.modules():
            if hasattr(m, "set_gradient_divide_factor"):
                m.set_gradient_divide_factor(divide)
    opt = make_optimizer(model.parameters())
    data = [micro_batch(rank, i, rows) for i, rows in enumerate(HSDP_LAYOUT[rank])]
    out: dict[str, Any] = {"params": [], "stats": [], "counts": [], "held": [], "hook": []}
    groups = {"replicate": mesh.get_group(0), "shard": mesh.get_group(1)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc = fb.Accumulator(model, opt, micro_batches=K, **options)
    out["warnings"] = [str(w.message) for w in caught]
    out["divisor"] = acc._engine.sync.divisor
    if hook:  # the hook sees the normalized full gradient (a collective: every rank runs it)
        acc.register_window_hook(
            lambda: out["hook"].append(
                torch.cat([p.grad.full_tensor().reshape(-1) for p in model.parameters()])
            )
        )
    with acc, _Counter(groups) as counter:
        for window in acc.windows(data):
            for i, micro in enumerate(window):
                loss_sum, n = fb.cross_entropy_sum(model(micro["x"]), micro["y"])
                window.backward(loss_sum, n)
                if i == 0 and window.index == 0:
                    out["held"].append(_held_grad_bytes(model))
                if i == 0 and window.index == 1 and options.get("fsdp_sync") != "micro_batch":
                    try:  # FSDP2 holds gradients outside .grad: refused mid-window
                        acc.state_dict()
                    except RuntimeError as exc:
                        out["state_error"] = str(exc)
            out["stats"].append(window.step())
            out["counts"].append(counter.take())
            out["params"].append(_full_params(model))
    out["state_at_boundary"] = sorted(acc.state_dict())  # fine between windows
    return out


def _refusals(rank: int, mesh: Any) -> dict[str, str]:
    """1-D "hybrid", HSDP with accumulate_dtype: ValueError before anything changes."""
    from torch.distributed.fsdp import fully_shard

    errors = {}
    model = fully_shard(make_model3())  # 1-D mesh over the 4 ranks
    before = _full_params(model)
    opt = make_optimizer(model.parameters())
    try:
        fb.Accumulator(model, opt, micro_batches=K, fsdp_sync="hybrid")
    except ValueError as exc:
        errors["hybrid-1d"] = str(exc)
    assert torch.equal(before, _full_params(model))
    model32 = _hsdp(make_model3().float(), mesh)
    try:
        fb.Accumulator(
            model32,
            make_optimizer(model32.parameters()),
            micro_batches=K,
            accumulate_dtype=torch.float64,
        )
    except ValueError as exc:
        errors["accumulate_dtype"] = str(exc)
    return errors


def cp_micro_batch(d: int, index: int, rows: int) -> dict[str, torch.Tensor]:
    """Full sequences ``[rows, T, IN]`` of data-parallel index ``d``; some halves unlabelled."""
    g = torch.Generator().manual_seed(7919 + d * 1009 + index)
    x = torch.randn(rows, T, IN, generator=g, dtype=torch.float64)
    y = torch.randint(0, OUT, (rows, T), generator=g)
    y[torch.rand(rows, T, generator=g) < 0.3] = -100
    if index == 1:  # the second half holds one counted token only (Megatron#7513's case)
        y[:, T // 2 :] = -100
        y[0, T - 1] = 1
    if index == 2:  # the second half holds no counted token: its rank still runs backward
        y[:, T // 2 :] = -100
    return {"x": x, "y": y}


def _cp_case(rank: int, inside: bool) -> dict[str, Any]:
    """DP index d = rank // 2, CP index c = rank % 2; CP rank c holds half c of each row."""
    dp = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    cp = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    d, c = rank // 2, rank % 2
    wrapper_group = dist.group.WORLD if inside else dp[c]
    model = nn.parallel.DistributedDataParallel(make_model3(), process_group=wrapper_group)
    ddp_calls = [0]

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def counting(state, bucket):  # type: ignore[no-untyped-def]  (DDP checks annotations)
        ddp_calls[0] += 1
        return default_hooks.allreduce_hook(state, bucket)

    model.register_comm_hook(wrapper_group, counting)
    opt = make_optimizer(model.parameters())
    half = slice(c * T // 2, (c + 1) * T // 2)
    data = []
    for i, rows in enumerate(CP_LAYOUT[d]):
        m = cp_micro_batch(d, i, rows)
        data.append({"x": m["x"][:, half], "y": m["y"][:, half]})
    out: dict[str, Any] = {"params": [], "stats": [], "counts": []}
    groups = {"dp": dp[c], "cp": cp[d]}
    with fb.Accumulator(model, opt, micro_batches=2, context_parallel=cp[d]) as acc:
        with _Counter(groups) as counter:
            for window in acc.windows(data):
                for micro in window:
                    logits = model(micro["x"])
                    loss_sum, n = fb.cross_entropy_sum(
                        logits.reshape(-1, OUT), micro["y"].reshape(-1)
                    )
                    window.backward(loss_sum, n)
                out["stats"].append(window.step())
                counts = counter.take()
                counts["ddp-hook"] = ddp_calls[0]
                ddp_calls[0] = 0
                out["counts"].append(counts)
                out["params"].append(_full_params(model))
    return out


AUTO_ROWS = [[8, 8, 6], [8, 5, 7], [6, 8, 8], [8, 6, 5]]  # per rank: rows of whole windows


def _hsdp_auto(rank: int, mesh: Any) -> dict[str, Any]:
    """micro_batch_size="auto", hybrid: rank 3 fits 3 rows and fails once more after backward
    calls (the partial shard FSDP2 holds of that attempt must be dropped)."""
    from _dist_auto import Fits, items
    from _dist_auto import make_model as fits_model

    fits = [10**9, 10**9, 10**9, 3][rank]
    model = _hsdp(fits_model(fits, (3,) if rank == 3 else ()), mesh)
    opt = make_optimizer(model.parameters())
    out: dict[str, Any] = {"params": [], "retries": []}
    with fb.Accumulator(model, opt, micro_batch_size="auto") as acc:
        for window in acc.windows(items(rank, AUTO_ROWS)):
            stats = window.run(lambda m: fb.cross_entropy_sum(model(m["x"]), m["y"]))
            out["params"].append(_full_params(model))
            out["retries"].append(stats.retries)
    out["calls"] = next(m for m in model.modules() if isinstance(m, Fits)).calls
    return out


def scale_cases(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    results: dict[str, Any] = {name: _hsdp_case(rank, mesh, o) for name, o in HSDP_CASES.items()}
    results["resume"] = hsdp_resume(rank, mesh)
    results["refusals"] = _refusals(rank, mesh)
    results["auto"] = _hsdp_auto(rank, mesh)
    results["cp-beside"] = _cp_case(rank, inside=False)
    results["cp-inside"] = _cp_case(rank, inside=True)
    return results


# -- references (parent process) ---------------------------------------------------------------


def hsdp_reference(max_grad_norm: float | None = None) -> dict[str, list[Any]]:
    """Plain float64 full batch on the union of the 4 ranks' window data: params, grads, norms."""
    data = [
        [micro_batch(r, i, rows) for i, rows in enumerate(lay)] for r, lay in enumerate(HSDP_LAYOUT)
    ]
    n_windows = max((len(d) + K - 1) // K for d in data)
    model = make_model3()
    opt = make_optimizer(model.parameters())
    out: dict[str, list[Any]] = {"params": [], "grads": [], "norms": [], "micro": []}
    for w in range(n_windows):
        window = [m for d in data for m in d[w * K : (w + 1) * K]]
        x = torch.cat([m["x"] for m in window])
        y = torch.cat([m["y"] for m in window])
        loss = nn.functional.cross_entropy(model(x), y, reduction="sum") / (y != -100).sum()
        opt.zero_grad()
        loss.backward()
        out["grads"].append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        norm = nn.utils.clip_grad_norm_(
            model.parameters(), max_grad_norm if max_grad_norm is not None else float("inf")
        )
        out["norms"].append(float(norm))
        opt.step()
        out["params"].append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        out["micro"].append(max(len(d[w * K : (w + 1) * K]) for d in data))
    return out


def cp_reference() -> list[torch.Tensor]:
    """Unsharded full batch: every DP index's full sequences of the window, token mean."""
    model = make_model3()
    opt = make_optimizer(model.parameters())
    n_windows = max((len(lay) + 1) // 2 for lay in CP_LAYOUT)
    snaps = []
    for w in range(n_windows):
        window = [
            cp_micro_batch(d, i, lay[i])
            for d, lay in enumerate(CP_LAYOUT)
            for i in range(2 * w, min(2 * w + 2, len(lay)))
        ]
        logits = torch.cat([model(m["x"]).reshape(-1, OUT) for m in window])
        y = torch.cat([m["y"].reshape(-1) for m in window])
        loss = nn.functional.cross_entropy(logits, y, reduction="sum") / (y != -100).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        snaps.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return snaps

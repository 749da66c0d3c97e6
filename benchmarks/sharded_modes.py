"""Collectives per window and gradient memory held, per FSDP2 mode, counted on 4 gloo ranks.

    torchrun --standalone --nproc-per-node 4 benchmarks/sharded_modes.py

For FSDP2 over a 1-D mesh (4 shards) and HSDP over a 2 x 2 (replicate, shard) mesh, with each
``fsdp_sync`` mode: a 3-layer float64 MLP (3 FSDP2 parameter groups), K=4 micro-batches per
window, 2 windows. The reduce-scatters and all-reduces that FSDP2 and fullbatch issue are
counted by wrapping the ``torch.distributed`` functions (by group); the gradient bytes a rank
holds after the first micro-batch's backward are read from ``.grad`` and FSDP2's own buffers
(private FSDP2 state of torch 2.13). Rank 0 prints one row per (mesh, mode).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

import fullbatch as fb

K, WINDOWS, WIDTH = 4, 2, 64


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 4)
    ).double()


def held_bytes(model: nn.Module) -> int:
    total = 0
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in module._get_fsdp_state()._fsdp_param_groups:
            partial = getattr(group, "_partial_reduce_output", None)
            total += 0 if partial is None else partial.numel() * partial.element_size()
            for fp in group.fsdp_params:
                unsharded = getattr(getattr(fp, "_unsharded_param", None), "grad", None)
                for t in (fp.unsharded_accumulated_grad, unsharded, fp.sharded_param.grad):
                    if t is not None:
                        local = t.to_local() if hasattr(t, "to_local") else t
                        total += local.numel() * local.element_size()
    return total


def run(mesh: Any, mode: str) -> tuple[Counter[str], int]:
    model = make_model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    names = {id(mesh.get_group(d)): n for d, n in enumerate(mesh.mesh_dim_names)}
    calls: Counter[str] = Counter()
    saved = {n: getattr(dist, n) for n in ("reduce_scatter_single", "all_reduce")}

    def counted(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            where = "world" if group in (None, dist.group.WORLD) else names.get(id(group), "?")
            calls[f"{'RS' if name.startswith('reduce') else 'AR'} {where}"] += 1
            return saved[name](*args, **kwargs)

        return call

    for name in saved:
        setattr(dist, name, counted(name))
    g = torch.Generator().manual_seed(dist.get_rank())
    data = [
        {"x": torch.randn(3, 8, generator=g, dtype=torch.float64), "y": torch.randint(0, 4, (3,))}
        for _ in range(K * WINDOWS)
    ]
    held = 0
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        with fb.Accumulator(model, opt, micro_batches=K, fsdp_sync=mode) as acc:
            for window in acc.windows(data):
                for i, micro in enumerate(window):
                    loss_sum, n = fb.cross_entropy_sum(model(micro["x"]), micro["y"])
                    window.backward(loss_sum, n)
                    if i == 0:
                        held = held_bytes(model)
                window.step()
    finally:
        for name, real in saved.items():
            setattr(dist, name, real)
    return calls, held


def main() -> None:
    dist.init_process_group("gloo")
    params = sum(p.numel() for p in make_model().parameters())
    meshes = {
        "1-D (4 shards)": init_device_mesh("cpu", (4,), mesh_dim_names=("shard",)),
        "HSDP 2 x 2": init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")),
    }
    rows = []
    for label, mesh in meshes.items():
        modes = ["window", "micro_batch"] + (["hybrid"] if mesh.ndim == 2 else [])
        for mode in modes:
            calls, held = run(mesh, mode)
            per = {k: v / WINDOWS for k, v in sorted(calls.items())}
            rows.append((label, mode, per, held))
    if dist.get_rank() == 0:
        print(f"model: {params} float64 parameters = {params * 8} bytes; K={K}, 3 FSDP2 groups")
        for label, mode, per, held in rows:
            shown = ", ".join(f"{k}: {v:g}" for k, v in per.items())
            print(f"{label:15} {mode:12} per window: {shown}; held {held} bytes")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

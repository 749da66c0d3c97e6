"""Rank functions for the multi-process tests, and the single-process references they meet.

Each rank function runs in a child process (see ``_dist.run_ranks``) and returns plain data:
the full parameters after every step, and the StepStats. The parent computes the float64
full-batch reference on the union of every rank's data and compares.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import fullbatch as fb

IN, HIDDEN, OUT = 6, 16, 4


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT)).double()


def micro_batch(rank: int, index: int, rows: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic micro-batch ``index`` of ``rank``; about a quarter of labels ignored."""
    g = torch.Generator().manual_seed(seed * 100_003 + rank * 1009 + index)
    x = torch.randn(rows, IN, generator=g, dtype=torch.float64)
    y = torch.randint(0, OUT, (rows,), generator=g)
    y[torch.rand(rows, generator=g) < 0.25] = -100
    return {"x": x, "y": y}


def rank_data(rank: int, layout: list[list[int]], seed: int = 0) -> list[dict[str, torch.Tensor]]:
    return [micro_batch(rank, i, rows, seed) for i, rows in enumerate(layout[rank])]


def reference_windows(
    layout: list[list[int]], k: int, drop: bool = False, seed: int = 0
) -> list[list[dict[str, torch.Tensor]]]:
    """The union of every rank's micro-batches, window by window (micro_batches=k per rank)."""
    data = [rank_data(r, layout, seed) for r in range(len(layout))]
    n_windows = max((len(d) + k - 1) // k for d in data)
    windows = []
    for w in range(n_windows):
        parts = [d[w * k : (w + 1) * k] for d in data]
        if drop and any(len(p) < k for p in parts):
            continue
        windows.append([m for p in parts for m in p])
    return windows


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def reference_run(
    windows: list[list[dict[str, torch.Tensor]]], max_grad_norm: float | None = None
) -> list[torch.Tensor]:
    """Plain PyTorch, float64, full batch: flat parameters after every non-skipped step."""
    model = make_model()
    opt = make_optimizer(model.parameters())
    out = []
    for window in windows:
        x = torch.cat([m["x"] for m in window])
        y = torch.cat([m["y"] for m in window])
        n = int((y != -100).sum())
        if n == 0:
            continue
        loss = nn.functional.cross_entropy(model(x), y, ignore_index=-100, reduction="sum") / n
        opt.zero_grad()
        loss.backward()
        if max_grad_norm is not None:
            nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        out.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return out


def _full_params(model: nn.Module) -> torch.Tensor:
    parts = []
    for p in model.parameters():
        t = p.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        parts.append(t.reshape(-1))
    return torch.cat(parts)


def wrap(model: nn.Module, wrapper: str, group: Any = None) -> nn.Module:
    if wrapper == "ddp":
        return nn.parallel.DistributedDataParallel(model, process_group=group)
    if wrapper == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        return fully_shard(model)
    raise ValueError(wrapper)


def train(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Train on this rank's micro-batches with fullbatch; return params after every step."""
    layout = spec["layout"]
    model = wrap(make_model(), spec["wrapper"])
    opt = make_optimizer(model.parameters())
    options = dict(spec.get("options", {}))
    if spec.get("padding"):
        options["padding_micro_batch"] = lambda: micro_batch(rank, 999, 2)
    data = rank_data(rank, layout, spec.get("seed", 0))
    loader = iter(data) if spec.get("unsized") else data
    snapshots, stats, paddings = [], [], []
    with fb.Accumulator(model, opt, micro_batches=spec["k"], **options) as acc:
        for window in acc.windows(loader):
            pads = 0
            for micro in window:
                pads += window.is_padding
                loss_sum, n = fb.cross_entropy_sum(model(micro["x"]), micro["y"])
                window.backward(loss_sum, n)
            s = window.step()
            stats.append(s)
            paddings.append(pads)
            if not s.skipped:
                snapshots.append(_full_params(model))
    return {"params": snapshots, "stats": stats, "paddings": paddings}


def reference_for(spec: dict[str, Any]) -> list[torch.Tensor]:
    drop = spec.get("options", {}).get("partial_window") == "drop"
    windows = reference_windows(spec["layout"], spec["k"], drop=drop, seed=spec.get("seed", 0))
    return reference_run(windows, spec.get("options", {}).get("max_grad_norm"))


def world_size() -> int:
    return dist.get_world_size()

"""Rank function for the host-read count under DDP (test_distributed_host_syncs.py).

Each rank trains a small causal LM through ``fb.Accumulator`` on the fake device of
``_sync_cases`` (every tensor of the model, its gradients and the data "on the GPU"), and
returns the reads per window and section.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import fullbatch as fb
from _sync_cases import DEVICE, HostSyncs, TinyLM, count_windows, lm_data


def ddp_host_reads(rank: int, world: int, options: dict[str, Any]) -> list[dict[str, Any]]:
    """Reads per window on this rank; the collective tensors live on the device, as NCCL
    needs (gloo moves the same CPU tensors underneath)."""
    from fullbatch._base._sync import Sync

    Sync.device = property(lambda self: DEVICE)  # type: ignore[assignment,method-assign]
    h = HostSyncs()
    torch.manual_seed(0)
    model = TinyLM()
    options = dict(options)
    micro_batches = options.pop("micro_batches", 2)
    windows = options.pop("windows", 4)
    scaler = options.pop("scaler", False)
    if options.pop("counts", False):
        options["counts"] = {"tokens": lambda m: fb.count_tokens(m["labels"])}
    with h:
        h.to_device(model)
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        acc = fb.Accumulator(
            ddp,
            opt,
            micro_batches=micro_batches,
            max_grad_norm=1.0,
            scaler=torch.amp.GradScaler("cpu") if scaler else None,
            **options,
        )
        loader = h.to_device(lm_data(micro_batches * windows, seed=rank))
        counted = count_windows(
            h, acc, loader, lambda m: fb.causal_lm_loss(ddp(m["input_ids"]), m["labels"])
        )
    return counted


def lazy_start_train(rank: int, world: int, layout: list[list[int]], k: int) -> dict[str, Any]:
    """``_dist_cases.train`` on the fake device, where the window-start table stays on the
    device unless a rank needs it: parameters after every step, padding, reads per window."""
    import _dist_cases as cases
    from fullbatch._base._sync import Sync

    Sync.device = property(lambda self: DEVICE)  # type: ignore[assignment,method-assign]
    h = HostSyncs()
    model = cases.make_model()
    with h:
        h.to_device(model)
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = cases.make_optimizer(ddp.parameters())
        data = h.to_device(cases.rank_data(rank, layout))
        params, paddings, opens = [], [], []
        with fb.Accumulator(ddp, opt, micro_batches=k) as acc:
            windows = iter(acc.windows(data))
            while True:
                h.reset()
                window = next(windows, None)
                if window is None:
                    break
                opens.append(h.count("read"))
                pads = 0
                for micro in window:
                    pads += window.is_padding
                    window.backward(*fb.cross_entropy_sum(ddp(micro["x"]), micro["y"]))
                window.step()
                paddings.append(pads)
                with h.quietly():
                    params.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return {"params": params, "paddings": paddings, "opens": opens}


def grads_before_window(rank: int, world: int, ranks: list[int]) -> list[float]:
    """Window 1 opens with gradients present on ``ranks``: those refuse it when it opens."""
    import _dist_cases as cases
    from fullbatch._base._sync import Sync

    Sync.device = property(lambda self: DEVICE)  # type: ignore[assignment,method-assign]
    h = HostSyncs()
    model = cases.make_model()
    with h:
        h.to_device(model)
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = cases.make_optimizer(ddp.parameters())
        data = h.to_device(cases.rank_data(rank, [[2, 3, 1, 2]] * world))
        with fb.Accumulator(ddp, opt, micro_batches=2) as acc:
            for window in acc.windows(data):
                for micro in window:
                    window.backward(*fb.cross_entropy_sum(ddp(micro["x"]), micro["y"]))
                window.step()
                if rank in ranks:
                    for p in model.parameters():
                        p.grad = torch.zeros_like(p)
        with h.quietly():
            return [float(p.detach().sum()) for p in model.parameters()]

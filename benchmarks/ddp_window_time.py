"""Seconds per window on data-parallel ranks: fullbatch vs a loop that syncs every micro-batch.

    torchrun --standalone --nproc-per-node 2 benchmarks/ddp_window_time.py

Both arms run the same model, data and K micro-batches per window; they alternate window by
window so that machine noise hits both alike. The sync-every-micro-batch arm is the plain DDP
loop without ``no_sync()``: one gradient all-reduce per micro-batch instead of one per window.
Rank 0 prints the median and the min-max of each arm and their ratio, measured in this run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import fullbatch as fb


def make_model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(64, width), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def micro_batch(rows: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(rows, 64, generator=generator), torch.randint(
        0, 10, (rows,), generator=generator
    )


def fullbatch_window(acc: fb.Accumulator, model: nn.Module, data: list) -> None:
    for window in acc.windows(data):
        for x, y in window:
            loss_sum, n = fb.cross_entropy_sum(model(x), y)
            window.backward(loss_sum, n)
        window.step()


def sync_every_window(model: nn.Module, opt: torch.optim.Optimizer, data: list) -> None:
    n_total = sum(len(y) for _, y in data)  # local rows: the same normalization work
    for x, y in data:  # no no_sync(): DDP all-reduces after every micro-batch
        loss_sum, _ = fb.cross_entropy_sum(model(x), y)
        (loss_sum / n_total).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=15, help="windows per arm (after warm-up)")
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None, help="rank 0 also writes results here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(rank)
    data = [micro_batch(args.rows, gen) for _ in range(args.micro_batches)]

    ddp_ours = nn.parallel.DistributedDataParallel(make_model(args.width, args.depth))
    ddp_sync = nn.parallel.DistributedDataParallel(make_model(args.width, args.depth))
    opt_ours = torch.optim.SGD(ddp_ours.parameters(), lr=1e-3)
    opt_sync = torch.optim.SGD(ddp_sync.parameters(), lr=1e-3)
    acc = fb.Accumulator(ddp_ours, opt_ours, micro_batches=args.micro_batches)
    arms = {
        "fullbatch (sync once per window)": lambda: fullbatch_window(acc, ddp_ours, data),
        "sync every micro-batch": lambda: sync_every_window(ddp_sync, opt_sync, data),
    }
    times: dict[str, list[float]] = {name: [] for name in arms}
    for rep in range(args.reps + 2):  # two warm-up rounds (DDP rebuilds buckets once)
        for name, run in arms.items():  # alternated
            dist.barrier()
            start = time.perf_counter()
            run()
            elapsed = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a window ends on its slowest rank
            if rep >= 2:
                times[name].append(float(elapsed))
    if rank == 0:
        params = sum(p.numel() for p in ddp_ours.parameters())
        setup = (
            f"{world} gloo ranks, 1 thread each, {params / 1e6:.2f}M parameters, "
            f"K={args.micro_batches} micro-batches of {args.rows} rows, {args.reps} windows per arm"
        )
        print(setup)
        medians = {}
        for name, ts in times.items():
            medians[name] = statistics.median(ts)
            spread = f"(min {min(ts):.4f}, max {max(ts):.4f})"
            print(f"  {name:34s} median {medians[name]:.4f} s/window  {spread}")
        ours, theirs = medians.values()
        print(f"  ratio sync-every / fullbatch: {theirs / ours:.2f}x")
        if args.json is not None:
            result = {"setup": setup, "fullbatch": ours, "sync_every": theirs, "world": world}
            result |= {"micro_batches": args.micro_batches, "params": params}
            args.json.write_text(json.dumps(result, indent=1) + "\n")
    acc.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

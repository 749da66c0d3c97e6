"""What ``micro_batch_size="auto"`` costs to find its size, in one process.

    python benchmarks/auto.py [--device cuda] [--rows 256] [--fits 24 48 100] [--repeats 5]

The model stands in for a device that runs out of memory: a layer raises
``torch.OutOfMemoryError`` when a forward sees more rows than ``--fits``. For each threshold,
a fresh Accumulator with ``micro_batch_size="auto"`` runs two windows of ``--rows`` rows
through ``window.run``: the first finds the size (halving from the whole window, one re-run
per halving), the second runs at the found size. A third arm runs a window with that size
given as an integer from the start. Medians over ``--repeats`` fresh runs; the cost of
finding the size is the first window's time minus a window at the found size.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import fullbatch as fb


class Fits(nn.Module):
    def __init__(self, rows: int) -> None:
        super().__init__()
        self.rows = rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.rows:
            raise torch.OutOfMemoryError(f"{x.shape[0]} rows do not fit")
        return x


def make_model(fits: int, device: str, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(width, 4 * width),
        nn.GELU(),
        Fits(fits),  # after the first layer: a failed attempt wastes a partial forward
        nn.Linear(4 * width, 4 * width),
        nn.GELU(),
        nn.Linear(4 * width, 16),
    ).to(device)


def batch(rows: int, width: int, device: str, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g).to(device)
    return {"x": x, "y": torch.randint(0, 16, (rows,), generator=g).to(device)}


def timed(fn: Callable[[], object], device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def one_run(fits: int, size: int | str, args: argparse.Namespace) -> tuple[list[float], Any]:
    model = make_model(fits, args.device, args.width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    acc = fb.Accumulator(model, opt, micro_batch_size=size)
    data = [batch(args.rows, args.width, args.device, seed) for seed in range(2)]
    times, stats = [], []
    for window in acc.windows(data):
        fn = lambda m: fb.cross_entropy_sum(model(m["x"]), m["y"])  # noqa: E731
        times.append(timed(lambda w=window, f=fn: stats.append(w.run(f)), args.device))
    acc.close()
    return times, (acc.micro_batch_size, stats[0].retries)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--fits", type=int, nargs="+", default=[24, 48, 100, 256])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    one_run(args.rows, args.rows, args)  # warm-up
    print(
        f"window of {args.rows} rows, MLP width {args.width}, device {args.device}; "
        f"medians over {args.repeats} fresh runs (s)"
    )
    head = ("fits", "found", "retries", "1st window", "2nd window", "fixed size", "finding cost")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for fits in args.fits:
        first, second, fixed = [], [], []
        found = retries = 0
        for _ in range(args.repeats):
            (t1, t2), (found, retries) = one_run(fits, "auto", args)
            (f1, _f2), _ = one_run(10**9, found, args)
            first.append(t1)
            second.append(t2)
            fixed.append(f1)
        m1, m2, mf = (statistics.median(t) for t in (first, second, fixed))
        cost = f"{m1 - mf:+.4f} s ({m1 / mf:.2f}x)"
        row = (fits, found, retries, f"{m1:.4f}", f"{m2:.4f}", f"{mf:.4f}", cost)
        print("| " + " | ".join(str(v) for v in row) + " |")


if __name__ == "__main__":
    main()

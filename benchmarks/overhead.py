"""Seconds per window in one process: fullbatch vs the hand-written loop it replaces.

    python benchmarks/overhead.py                      # micro-batches of 1, 4 and 16 rows
    python benchmarks/overhead.py --sizes 4 --reps 40  # one size

Both arms compute the same thing: a window of ``--window-rows`` padded rows of a tiny causal LM,
split into micro-batches of M rows, summed losses, one normalization by the window's token
count, clipping and an AdamW step. The hand-written arm counts tokens up front and
backpropagates ``loss_sum / N``; fullbatch backpropagates ``c · loss_sum`` and rescales at the
step (plus its bookkeeping: counts on the device, the norm, the checks). Smaller micro-batches
mean more micro-batches per window, so 1-row micro-batches show the per-micro-batch cost at
its largest.

For each size the arms alternate window by window in one process (ABBA order, so neither arm
always runs first), after warm-up windows. The table gives each arm's median seconds per
window, the ratio of the medians with its 95% confidence interval (a bootstrap over the
windows, resampled in pairs), and the spread of the per-window ratios (25th to 75th
percentile): a ratio is only known to within its interval.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import fullbatch as fb


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 256, width: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        return self.head(h + self.mlp(h))


def make_window(k: int, rows: int, length: int, gen: torch.Generator) -> list[dict]:
    window = []
    for _ in range(k):
        ids = torch.randint(0, 256, (rows, length), generator=gen)
        labels = ids.clone()
        lengths = torch.randint(length // 4, length + 1, (rows,), generator=gen)
        labels[torch.arange(length)[None, :] >= lengths[:, None]] = -100
        window.append({"input_ids": ids, "labels": labels})
    return window


def hand_written(model: nn.Module, opt: torch.optim.Optimizer, window: list[dict]) -> None:
    n = sum(fb.count_tokens(m["labels"]) for m in window)
    for m in window:
        loss_sum, _ = fb.causal_lm_loss(model(m["input_ids"]), m["labels"])
        (loss_sum / n).backward()
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def with_fullbatch(acc: fb.Accumulator, model: nn.Module, window: list[dict]) -> None:
    for w in acc.windows(window):
        for m in w:
            w.backward(*fb.causal_lm_loss(model(m["input_ids"]), m["labels"]))
        w.step()


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def bootstrap(hand: list[float], ours: list[float], *, draws: int = 2000) -> tuple[float, float]:
    """95% interval of median(ours) / median(hand), resampling the windows in pairs."""
    rng = random.Random(0)
    n = len(hand)
    ratios = []
    for _ in range(draws):
        pick = [rng.randrange(n) for _ in range(n)]
        mine = statistics.median(ours[i] for i in pick)
        ratios.append(mine / statistics.median(hand[i] for i in pick))
    return quantile(ratios, 0.025), quantile(ratios, 0.975)


def measure(size: int, args: argparse.Namespace) -> dict[str, float]:
    """Both arms at micro-batches of ``size`` rows; medians, ratio and the paired spread."""
    k = args.window_rows // size
    gen = torch.Generator().manual_seed(size)
    windows = [make_window(k, size, args.length, gen) for _ in range(4)]
    torch.manual_seed(0)
    ours, theirs = TinyLM(), TinyLM()
    theirs.load_state_dict(ours.state_dict())
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-3)
    opt_theirs = torch.optim.AdamW(theirs.parameters(), lr=1e-3)
    acc = fb.Accumulator(ours, opt_ours, micro_batches=k, max_grad_norm=1.0)
    arms: dict[str, Callable[[list[dict]], None]] = {
        "hand": lambda w: hand_written(theirs, opt_theirs, w),
        "fullbatch": lambda w: with_fullbatch(acc, ours, w),
    }
    times: dict[str, list[float]] = {name: [] for name in arms}
    for rep in range(args.warmup + args.reps):
        window = windows[rep % len(windows)]
        order = list(arms) if rep % 2 == 0 else list(arms)[::-1]  # ABBA: no fixed first arm
        for name in order:
            start = args.clock()
            arms[name](window)
            if rep >= args.warmup:
                times[name].append(args.clock() - start)
    acc.close()
    paired = [f / h for f, h in zip(times["fullbatch"], times["hand"], strict=True)]
    hand, ours_median = statistics.median(times["hand"]), statistics.median(times["fullbatch"])
    low, high = bootstrap(times["hand"], times["fullbatch"])
    return {
        "micro_batch_size": size,
        "micro_batches": k,
        "hand": hand,
        "fullbatch": ours_median,
        "ratio": ours_median / hand,
        "ci_low": low,
        "ci_high": high,
        "q1": quantile(paired, 0.25),
        "q3": quantile(paired, 0.75),
    }


NOTE = (
    "medians; ratio = fullbatch / hand-written with its 95% bootstrap interval; spread: 25th to "
    "75th percentile of the per-window ratio"
)
HEADER = (
    "| micro-batch rows | micro-batches | hand-written s/window | fullbatch s/window | ratio "
    "| 95% interval | spread |\n|---:|---:|---:|---:|---:|---:|---:|"
)


def table_row(row: dict[str, float]) -> str:
    return (
        f"| {row['micro_batch_size']} | {row['micro_batches']} | {row['hand']:.4f} | "
        f"{row['fullbatch']:.4f} | {row['ratio']:.3f} | {row['ci_low']:.3f}-{row['ci_high']:.3f} "
        f"| {row['q1']:.3f}-{row['q3']:.3f} |"
    )


def sizes(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=sizes, default=[1, 4, 16], help="rows per micro-batch")
    parser.add_argument("--window-rows", type=int, default=32, help="rows per window")
    parser.add_argument("--length", type=int, default=128, help="tokens per row")
    parser.add_argument("--reps", type=int, default=60, help="windows per arm and size")
    parser.add_argument("--warmup", type=int, default=4, help="windows per arm, not timed")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="wall: time.perf_counter; cpu: this thread's CPU time (time.thread_time), steadier "
        "on a machine shared with other jobs (time spent waiting for a core is not counted)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()
    clock_name = args.clock
    args.clock = time.perf_counter if args.clock == "wall" else time.thread_time
    bad = [m for m in args.sizes if m < 1 or args.window_rows % m]
    if bad:
        parser.error(f"--sizes {bad} must be positive divisors of --window-rows {args.window_rows}")
    torch.set_num_threads(args.threads)
    params = sum(p.numel() for p in TinyLM().parameters())
    setup = (
        f"1 process, {args.threads} thread(s), torch {torch.__version__}, "
        f"{params / 1e6:.2f}M parameters, windows of {args.window_rows} rows x {args.length} "
        f"tokens, {args.reps} windows per arm and size, {clock_name} clock"
    )
    print(f"{setup}; {NOTE}")
    print(HEADER)
    rows = []
    for size in args.sizes:
        row = measure(size, args)
        rows.append(row)
        print(table_row(row), flush=True)
    if args.json is not None:
        table = [table_row(row) for row in rows]
        result = {"setup": setup, "note": NOTE, "header": HEADER, "table": table, "rows": rows}
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

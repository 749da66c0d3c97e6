"""Seconds per window in one process: fullbatch vs the hand-written loop it replaces.

    python benchmarks/overhead.py

Both arms compute the same thing: K micro-batches of a tiny causal LM with padded rows, summed
losses, one normalization by the window's token count, clipping and an AdamW step. The
hand-written arm counts tokens up front and backpropagates ``loss_sum / N``; fullbatch
backpropagates ``c · loss_sum`` and rescales at the step (plus its bookkeeping: counts on the
device, the norm, the checks). The arms alternate window by window; the script prints the
median and min-max of each and their ratio, measured in this run.
"""

from __future__ import annotations

import argparse
import statistics
import time

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    windows = [make_window(args.micro_batches, args.rows, args.length, gen) for _ in range(4)]
    torch.manual_seed(0)
    ours, theirs = TinyLM(), TinyLM()
    theirs.load_state_dict(ours.state_dict())
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-3)
    opt_theirs = torch.optim.AdamW(theirs.parameters(), lr=1e-3)
    acc = fb.Accumulator(ours, opt_ours, micro_batches=args.micro_batches, max_grad_norm=1.0)
    arms = {
        "fullbatch": lambda w: with_fullbatch(acc, ours, w),
        "hand-written loss_sum / N": lambda w: hand_written(theirs, opt_theirs, w),
    }
    times: dict[str, list[float]] = {name: [] for name in arms}
    for rep in range(args.reps + 2):  # two warm-up rounds
        window = windows[rep % len(windows)]
        for name, run in arms.items():
            start = time.perf_counter()
            run(window)
            if rep >= 2:
                times[name].append(time.perf_counter() - start)
    params = sum(p.numel() for p in ours.parameters())
    print(
        f"1 process, {args.threads} thread(s), {params / 1e6:.2f}M parameters, "
        f"K={args.micro_batches} micro-batches of {args.rows}x{args.length} tokens, "
        f"{args.reps} windows per arm"
    )
    for name, ts in times.items():
        spread = f"(min {min(ts):.4f}, max {max(ts):.4f})"
        print(f"  {name:28s} median {statistics.median(ts):.4f} s/window  {spread}")
    a, b = (statistics.median(ts) for ts in times.values())
    print(f"  ratio fullbatch / hand-written: {a / b:.3f}")
    acc.close()


if __name__ == "__main__":
    main()

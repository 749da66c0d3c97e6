"""fullbatch's own cost in microseconds: a model so small that bookkeeping is all there is.

    python benchmarks/bookkeeping.py [--reps 200]

``benchmarks/overhead.py`` compares seconds per window on a model that does real work, where
the ratio is known only to a few percent on a shared machine. This script isolates the
bookkeeping instead: a 2k-parameter model, 1-row micro-batches of 16 tokens, windows of 2 and
32 micro-batches, clipping and AdamW in both arms. The hand-written arm counts tokens up
front and backpropagates ``loss_sum / N``; fullbatch seeds backward with ``c`` and does its
checks, sums and the step in its fixed order. Arms alternate; medians over ``--reps`` windows.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import fullbatch as fb


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    print(f"{sum(p.numel() for p in model.parameters())} parameters, 1 thread, {args.reps} reps")
    print("micro-batches  hand-written ms  fullbatch ms  fullbatch - hand (us/window)")
    for k in (2, 32):
        window = []
        for _ in range(k):
            ids = torch.randint(0, 64, (1, 16))
            labels = ids.clone()
            labels[:, 10:] = -100
            window.append({"input_ids": ids, "labels": labels})
        acc = fb.Accumulator(model, opt, micro_batches=k, max_grad_norm=1.0)

        def ours(acc: fb.Accumulator = acc, window: list = window) -> None:
            for w in acc.windows(window):
                for m in w:
                    w.backward(*fb.causal_lm_loss(model(m["input_ids"]), m["labels"]))
                w.step()

        def hand(window: list = window) -> None:
            n = sum(fb.count_tokens(m["labels"]) for m in window)
            for m in window:
                loss_sum, _ = fb.causal_lm_loss(model(m["input_ids"]), m["labels"])
                (loss_sum / n).backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        for run in (ours, hand, ours, hand):  # warm-up
            run()
        times: dict[str, list[float]] = {"ours": [], "hand": []}
        for _ in range(args.reps):
            for name, run in (("ours", ours), ("hand", hand)):
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
        a, b = statistics.median(times["ours"]), statistics.median(times["hand"])
        print(f"{k:13d}  {b * 1e3:15.3f}  {a * 1e3:12.3f}  {(a - b) * 1e6:+28.0f}")
        acc.close()


if __name__ == "__main__":
    main()

"""fullbatch's own cost per micro-batch, and what each check of the watch list costs.

    python benchmarks/watch_cost.py               # both tables (~1 min)
    python benchmarks/watch_cost.py --windows 80  # more micro-batches for table 2

Per-call timings in one process, robust to a shared machine: a check's cost is the minimum
over ``--repeat`` runs of ``--number`` calls (what is left above it is other jobs' time), and a
micro-batch's cost is the median over many micro-batches, both loops alternating window by
window.

1. **The watch list** (``src/fullbatch/_engine/_checks.py``): each check's hooks in
   microseconds per call, and how long it stays in the list. One-time checks drop out after
   they ran; a steady-state micro-batch meets only those marked "every micro-batch".
2. **One micro-batch of the plain loop** on a 2k-parameter model (1 row of 16 tokens: the
   model costs little, so bookkeeping shows): the hand-written loop's ``model`` +
   ``fb.causal_lm_loss`` + ``(loss_sum / N).backward()`` against ``for micro in window`` +
   ``window.backward(loss_sum, n)``; their difference is fullbatch's own cost per micro-batch
   (the step, once per window, is not in it).
"""

from __future__ import annotations

import argparse
import time
import timeit
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import fullbatch as fb

K = 32  # micro-batches per window


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 64))


def micro_batches(k: int = K, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    window = []
    for _ in range(k):
        ids = torch.randint(0, 64, (1, 16), generator=gen)
        labels = ids.clone()
        labels[:, 10:] = -100
        window.append({"input_ids": ids, "labels": labels})
    return window


def per_call(fn: Callable[[], Any], number: int, repeat: int) -> float:
    """Microseconds per call: the fastest of ``repeat`` runs of ``number`` calls."""
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


STAYS = {
    "LoopGuard": "every micro-batch (the sentinel gradient)",
    "SameLossTwice": "every micro-batch",
    "LearningRateWatch": "every micro-batch, without scheduler=",
    "ShareWithoutTotals": "share-form backward calls, with counts=, until it warns",
    "LabelCheck": "first 2 backward calls with a count",
    "LoaderChecks": "first window (micro_batch_size: first 2 windows)",
    "ForwardRoute": "first window, DDP with ddp_sync='last' (not built here: one process)",
    "FirstWindowCheck": "pack=True: until the first packed micro-batch of 2 rows (once)",
}


def watch_table(number: int, repeat: int) -> list[str]:
    """Each watch's hooks, per call, on an Accumulator that has every local check."""
    from fullbatch._engine._watch import Watch  # here: --only loop also runs on older trees

    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    counts = {"tokens": lambda m: fb.count_tokens(m["labels"])}
    acc = fb.Accumulator(model, opt, micro_batch_size=1, counts=counts)
    window_item = {k: torch.cat([m[k] for m in micro_batches()]) for k in ("input_ids", "labels")}
    engine = acc._engine
    watches = list(engine.watches)  # before the first window: every check is still there
    window = next(iter(acc.windows([window_item])))
    iterator = iter(window)
    micro = next(iterator)
    loss, n = fb.causal_lm_loss(model(micro["input_ids"]), micro["labels"])
    window.backward(loss, n)
    state = window._state
    loss, n = fb.causal_lm_loss(model(micro["input_ids"]), micro["labels"])
    state.current_backwards = 0  # each timed call sees the micro-batch's first backward
    state.totals_read = True  # the share check passes (it would warn once, then drop out)
    rows = []
    for watch in watches:
        name = type(watch).__name__
        if name == "LabelCheck":
            watch._left = 10**9  # type: ignore[attr-defined]  # stay in the list while timed
        hooks = {
            point: getattr(watch, point)
            for point in ("on_micro_batch", "before_backward", "after_backward", "before_step")
            if getattr(type(watch), point) is not getattr(Watch, point)  # else never called
        }
        per_micro = [
            hooks[p] for p in ("on_micro_batch", "before_backward", "after_backward") if p in hooks
        ]

        def one_micro_batch(hooks: dict[str, Any] = hooks) -> None:
            if "on_micro_batch" in hooks:
                hooks["on_micro_batch"](state, micro)
            if "before_backward" in hooks:
                hooks["before_backward"](state, loss, n)
            if "after_backward" in hooks:
                hooks["after_backward"](state)

        micro_us = per_call(one_micro_batch, number, repeat) if per_micro else 0.0
        step = hooks.get("before_step")
        step_us = per_call(lambda s=step: s(state), number, repeat) if step is not None else 0.0
        points = ", ".join(hooks)
        rows.append(f"| {name} | {points} | {micro_us:.2f} | {step_us:.2f} | {STAYS[name]} |")
    window.discard()
    acc.close()
    return rows


def loop_table(windows: int, model: str = "tiny", clock: str = "wall") -> tuple[list[str], float]:
    """Per micro-batch: the hand loop, fullbatch's plain loop, and the difference.

    ``model="overhead"``: ``benchmarks/overhead.py``'s 0.2M-parameter model and 128-token rows,
    where the model's own work leaves the caches cold for the bookkeeping (it costs more there
    than on the 2k-parameter model). ``clock="cpu"``: this thread's CPU time.
    """
    if model == "overhead":
        from overhead import TinyLM, make_window  # beside this script

        torch.manual_seed(0)
        hand_model, our_model = TinyLM(), TinyLM()
        our_model.load_state_dict(hand_model.state_dict())
        gen = torch.Generator().manual_seed(1)
        data = [make_window(K, 1, 128, gen) for _ in range(4)]
    else:
        hand_model, our_model = tiny_model(), tiny_model()
        data = [micro_batches(seed=s) for s in range(4)]
    hand_opt = torch.optim.AdamW(hand_model.parameters(), lr=0.01)
    our_opt = torch.optim.AdamW(our_model.parameters(), lr=0.01)
    acc = fb.Accumulator(our_model, our_opt, micro_batches=K, max_grad_norm=1.0)
    now_fn = time.perf_counter if clock == "wall" else time.thread_time
    times: dict[str, list[float]] = {"hand": [], "fullbatch": []}

    def hand(window: list[dict[str, torch.Tensor]], keep: bool) -> None:
        n = sum(fb.count_tokens(m["labels"]) for m in window)
        start = now_fn()
        for m in window:
            loss_sum, _ = fb.causal_lm_loss(hand_model(m["input_ids"]), m["labels"])
            (loss_sum / n).backward()
            now = now_fn()
            if keep:
                times["hand"].append(now - start)
            start = now
        nn.utils.clip_grad_norm_(hand_model.parameters(), 1.0)
        hand_opt.step()
        hand_opt.zero_grad(set_to_none=True)

    def ours(window: list[dict[str, torch.Tensor]], keep: bool) -> None:
        for w in acc.windows(window):
            start = now_fn()
            for m in w:
                w.backward(*fb.causal_lm_loss(our_model(m["input_ids"]), m["labels"]))
                now = now_fn()
                if keep:
                    times["fullbatch"].append(now - start)
                start = now
            w.step()

    for rep in range(windows + 4):
        window, keep = data[rep % len(data)], rep >= 4
        if rep % 2:
            hand(window, keep)
            ours(window, keep)
        else:
            ours(window, keep)
            hand(window, keep)
    acc.close()
    hand = [quantile(times["hand"], q) * 1e6 for q in (0.1, 0.5)]
    ours = [quantile(times["fullbatch"], q) * 1e6 for q in (0.1, 0.5)]
    rows = [
        "| hand-written: model, fb.causal_lm_loss, (loss_sum / N).backward() | "
        f"{hand[0]:.1f} | {hand[1]:.1f} |",
        "| fullbatch: next(window), model, fb.causal_lm_loss, window.backward | "
        f"{ours[0]:.1f} | {ours[1]:.1f} |",
        f"| fullbatch's own cost per micro-batch | {ours[0] - hand[0]:+.1f} | "
        f"{ours[1] - hand[1]:+.1f} |",
    ]
    return rows, ours[0] - hand[0]


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--number", type=int, default=20000, help="calls per timing run")
    parser.add_argument("--repeat", type=int, default=7, help="timing runs (the fastest counts)")
    parser.add_argument("--windows", type=int, default=40, help="windows of 32 micro-batches")
    parser.add_argument("--only", choices=["watches", "loop"], default=None)
    parser.add_argument(
        "--model", choices=["tiny", "overhead"], default="tiny",
        help="the loop's model: 2k parameters, or benchmarks/overhead.py's 0.2M",
    )  # fmt: skip
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread")
    if args.only != "loop":
        print(
            f"\nThe watch list: microseconds per call, the fastest of {args.repeat} runs of "
            f"{args.number} calls\n\n| watch | hooks | us per micro-batch | us per step "
            "| in the list |\n|---|---|---:|---:|---|"
        )
        for row in watch_table(args.number, args.repeat):
            print(row, flush=True)
    if args.only != "watches":
        rows, _ = loop_table(args.windows, args.model, args.clock)
        size = "2k parameters" if args.model == "tiny" else "0.2M parameters, 128 tokens"
        print(
            f"\nOne micro-batch of the plain loop, 1 row, {size}, {args.windows} windows of {K}, "
            f"{args.clock} clock (10th percentile and median)\n\n| per micro-batch | us, p10 "
            "| us, median |\n|---|---:|---:|"
        )
        for row in rows:
            print(row)


if __name__ == "__main__":
    main()

"""How many distinct micro-batch shapes a run meets, with and without ``pad_to_multiple_of``.

    python benchmarks/shapes.py                   # 200 windows, the table below (~20 s, CPU)
    python benchmarks/shapes.py --windows 1000

No model runs: each arm cuts the same windows into micro-batches (fullbatch's own splitters for
the fullbatch arms) and counts the distinct ``(rows, width)`` pairs, the padded tokens computed
per real token, and the micro-batches per window. Windows of 64 rows whose lengths are
lognormal (median 300, sigma 1) clipped to 16..2048, each window padded to its own longest
row, as a collator pads. On a GPU every new shape costs an attention plan, a compiled graph or
a CUDA graph; what that costs in seconds is measured on a GPU by
``python scripts/gpu_check.py --rows shapes``, not here.

The arms: the hand loop's 8-row micro-batches in loader order (each trimmed to its own
longest row, or rounded up to x128); ``micro_batch_size=8`` (the window's width);
``sort_rows=True``; ``micro_batch_tokens`` 3200 and 16384; each fullbatch arm with
``pad_to_multiple_of`` 64 and 128. ``last=pow2`` is a row policy fullbatch does not use,
simulated here to show why: a token budget's last micro-batch (the rows the budget does not
fill) cut into power-of-two row counts, fewer shapes for more micro-batches.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

import torch

from fullbatch._base._widths import Widths
from fullbatch._engine._micro_plan import MicroBatchPlan

ROWS, MICRO_ROWS = 64, 8


def lengths(windows: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(windows):
        z = torch.randn(ROWS, generator=gen, dtype=torch.float64)
        out.append([min(max(int(300 * math.exp(v)), 16), 2048) for v in z.tolist()])
    return out


def window(row_lengths: list[int]) -> dict[str, torch.Tensor]:
    width = max(row_lengths)
    mask = (torch.arange(width)[None, :] < torch.tensor(row_lengths)[:, None]).long()
    ids = mask * 5
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def hand(multiple: int | None) -> Callable[[list[int]], list[tuple[int, int]]]:
    """The hand loop: 8 rows in loader order, each micro-batch trimmed to its longest row."""
    widths = Widths(multiple)

    def cut(row_lengths: list[int]) -> list[tuple[int, int]]:
        window_width = max(row_lengths)
        out = []
        for i in range(0, len(row_lengths), MICRO_ROWS):
            part = row_lengths[i : i + MICRO_ROWS]
            out.append((len(part), min(widths.round(max(part)), widths.round(window_width))))
        return out

    return cut


def fullbatch(**options: Any) -> Callable[[list[int]], list[tuple[int, int]]]:
    """fullbatch's own splitter (``MicroBatchPlan``, as the Accumulator builds it)."""
    plan = MicroBatchPlan(**options)

    def cut(row_lengths: list[int]) -> list[tuple[int, int]]:
        return [tuple(m["input_ids"].shape) for m in plan.cut(window(row_lengths))]  # type: ignore[misc]

    return cut


def pow2_last(tokens: int, multiple: int) -> Callable[[list[int]], list[tuple[int, int]]]:
    """fullbatch's grouping for a token budget, with the rows left at the end of a window cut
    into power-of-two row counts (simulated: fullbatch takes them in one micro-batch)."""
    widths = Widths(multiple)

    def cut(row_lengths: list[int]) -> list[tuple[int, int]]:
        ordered = sorted(row_lengths, reverse=True)
        widest = widths.round(ordered[0]) if ordered[-1] < ordered[0] else ordered[0]
        out, i = [], 0
        while i < len(ordered):
            wide = min(widths.round(ordered[i]), widest)
            full = max(tokens // wide, 1)
            left = len(ordered) - i
            take = full if left >= full else 1 << (left.bit_length() - 1)
            out.append((take, wide))
            i += take
        return out

    return cut


Cut = Callable[[list[int]], list[tuple[int, int]]]


def arms() -> list[tuple[str, Cut]]:
    out: list[tuple[str, Cut]] = [
        ("hand loop, trimmed to the longest row", hand(None)),
        ("hand loop, rounded up to x128", hand(128)),
        ("micro_batch_size=8 (window width)", fullbatch(micro_batch_size=8)),
    ]
    for m in (None, 64, 128):
        cut = fullbatch(micro_batch_size=8, sort_rows=True, pad_to_multiple_of=m)
        out.append((f"sort_rows=True, pad_to_multiple_of={m}", cut))
    for tokens in (3200, 16384):
        for m in (None, 64, 128):
            cut = fullbatch(micro_batch_tokens=tokens, pad_to_multiple_of=m)
            out.append((f"micro_batch_tokens={tokens}, pad_to_multiple_of={m}", cut))
            if m is not None:
                name = f"micro_batch_tokens={tokens}, pad_to_multiple_of={m}, last=pow2"
                out.append((name, pow2_last(tokens, m)))
    return out


def measure(cut: Cut, data: list[list[int]]) -> dict[str, float]:
    seen: set[tuple[int, int]] = set()
    after: dict[int, int] = {}
    computed = micro = 0
    for w, row_lengths in enumerate(data, start=1):
        shapes = cut(row_lengths)
        seen.update(shapes)
        computed += sum(r * t for r, t in shapes)
        micro += len(shapes)
        if w in (8, 50):
            after[w] = len(seen)
    real = sum(sum(w) for w in data)
    return {
        "after8": after.get(8, len(seen)),
        "after50": after.get(50, len(seen)),
        "total": len(seen),
        "padding": computed / real,
        "micro": micro / len(data),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--windows", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    data = lengths(args.windows, args.seed)
    print(
        f"{args.windows} windows of {ROWS} rows, lengths lognormal (median 300, sigma 1) "
        f"clipped to 16..2048 (mean {sum(map(sum, data)) / len(data) / ROWS:.0f}); distinct "
        "(rows, width) shapes after 8, 50 and all windows; computed / real tokens; "
        "micro-batches per window\n"
    )
    print(
        "| arm | shapes after 8 | after 50 | after all | computed / real tokens "
        "| micro-batches / window |\n|---|---:|---:|---:|---:|---:|"
    )
    for name, cut in arms():
        r = measure(cut, data)
        print(
            f"| {name} | {r['after8']} | {r['after50']} | {r['total']} | {r['padding']:.2f} "
            f"| {r['micro']:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()

"""Shape churn on a GPU: seconds per window while micro-batch shapes are new, and once seen.

    python scripts/gpu_shapes.py                    # every arm, cuDNN attention, then backends
    python scripts/gpu_shapes.py --cpu              # a tiny smoke run (tests/package)
    python scripts/gpu_check.py --rows shapes       # the same, as a row of the GPU check

A ~168M-parameter Llama built from a config (bf16 weights, sdpa attention, AdamW), windows of 64
rows whose lengths are lognormal (median 300, sigma 1) clipped to 16..2048, each window padded
to its own longest row. Each arm trains ``--windows`` windows twice in a fresh process: the
first pass meets its micro-batch shapes for the first time (an attention plan per shape, and
every other per-shape cost of the stack), the second pass meets them again. The arms:

- the hand loop, 8-row micro-batches in loader order, each trimmed to its longest row, and
  rounded up to x128;
- ``micro_batch_size=8`` (the window's width);
- ``micro_batch_size=8, sort_rows=True``, ``micro_batch_tokens=3200`` and ``=16384``, each with
  exact widths (``pad_to_multiple_of=1``) and with ``pad_to_multiple_of=64``.

Then the attention backends (cuDNN, memory-efficient, math, flash where it runs with a padding
mask) on two arms, ``sort_rows`` exact and x64, over ``--backend-windows`` windows. Columns:
seconds for the pass, real tokens per second, distinct (rows, width) shapes. A GPU holder
runs it in a few minutes; docs quote its numbers with the card's name.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch

import fullbatch as fb

ROWS, MICRO_ROWS = 64, 8
ARMS = {
    "hand": "hand loop, trimmed to the longest row",
    "hand128": "hand loop, rounded up to x128",
    "size8": "micro_batch_size=8 (window width)",
    "sort": "sort_rows=True, exact widths",
    "sort64": "sort_rows=True, pad_to_multiple_of=64",
    "tokens3200": "micro_batch_tokens=3200, exact widths",
    "tokens3200_64": "micro_batch_tokens=3200, pad_to_multiple_of=64",
    "tokens16384": "micro_batch_tokens=16384, exact widths",
    "tokens16384_64": "micro_batch_tokens=16384, pad_to_multiple_of=64",
}
BACKENDS = ("cudnn", "efficient", "math", "flash")
BACKEND_ARMS = ("sort", "sort64")
#: the CPU smoke run: a tiny model, short rows, budgets scaled down with them
CPU = {"rows": 8, "micro_rows": 4, "longest": 40, "median": 10, "tokens": (48, 160), "m": 16}


def lengths(windows: int, *, rows: int, median: float, longest: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(windows):
        z = torch.randn(rows, generator=gen, dtype=torch.float64).tolist()
        out.append([min(max(int(median * math.exp(v)), 2), longest) for v in z])
    return out


def make_window(row_lengths: list[int], vocab: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    width = max(row_lengths)
    mask = (torch.arange(width)[None, :] < torch.tensor(row_lengths)[:, None]).long()
    ids = torch.randint(3, vocab, mask.shape, generator=gen) * mask
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def make_model(cpu: bool) -> Any:
    import transformers

    sizes = (
        {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "vocab_size": 64,
         "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 64}
        if cpu
        else {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
              "vocab_size": 32000, "num_attention_heads": 12, "num_key_value_heads": 12,
              "max_position_embeddings": 2048}
    )  # fmt: skip
    config = transformers.LlamaConfig(**sizes, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _loss(model: Any, micro: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"]).logits
    return fb.causal_lm_loss(logits, micro["labels"])


def _hand_micro_batches(
    window: dict[str, torch.Tensor], row_lengths: list[int], micro_rows: int, multiple: int
) -> list[dict[str, torch.Tensor]]:
    """The hand loop's micro-batches: rows in loader order, trimmed (on the host's lengths)."""
    width = window["input_ids"].shape[1]
    out = []
    for start in range(0, len(row_lengths), micro_rows):
        longest = max(row_lengths[start : start + micro_rows])
        keep = min(-(-longest // multiple) * multiple, width)
        out.append({k: v[start : start + micro_rows, :keep] for k, v in window.items()})
    return out


def run_arm(arm: str, *, cpu: bool, windows: int, backend: str, seed: int = 0) -> dict[str, Any]:
    """One arm in this process: the first pass (shapes new) and the second (shapes seen)."""
    device = torch.device("cpu") if cpu else torch.device("cuda")
    shape = CPU if cpu else {"rows": ROWS, "micro_rows": MICRO_ROWS, "longest": 2048,
                             "median": 300, "tokens": (3200, 16384), "m": 64}  # fmt: skip
    with device:  # built where it trains (a 168M model initialises in seconds on a GPU)
        model = make_model(cpu).to(torch.float32 if cpu else torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    vocab = model.config.vocab_size
    data_lengths = lengths(windows, rows=shape["rows"], median=shape["median"],
                           longest=shape["longest"], seed=seed)  # fmt: skip
    data = [make_window(w, vocab, seed + i) for i, w in enumerate(data_lengths)]
    data = [{k: v.to(device) for k, v in w.items()} for w in data]
    small, large = shape["tokens"]
    m = shape["m"]
    options = {
        "size8": {"micro_batch_size": shape["micro_rows"]},
        "sort": {"micro_batch_size": shape["micro_rows"], "sort_rows": True,
                 "pad_to_multiple_of": 1},
        "sort64": {"micro_batch_size": shape["micro_rows"], "sort_rows": True,
                   "pad_to_multiple_of": m},
        "tokens3200": {"micro_batch_tokens": small, "pad_to_multiple_of": 1},
        "tokens3200_64": {"micro_batch_tokens": small, "pad_to_multiple_of": m},
        "tokens16384": {"micro_batch_tokens": large, "pad_to_multiple_of": 1},
        "tokens16384_64": {"micro_batch_tokens": large, "pad_to_multiple_of": m},
    }  # fmt: skip
    shapes: set[tuple[int, ...]] = set()

    def hand_pass() -> None:
        multiple = 128 if arm == "hand128" else 1
        if cpu:
            multiple = min(multiple, m)
        for window, row_lengths in zip(data, data_lengths, strict=True):
            n = sum(max(k - 1, 0) for k in row_lengths)  # known on the host: no sync
            for micro in _hand_micro_batches(window, row_lengths, shape["micro_rows"], multiple):
                shapes.add(tuple(micro["input_ids"].shape))
                loss_sum, _ = _loss(model, micro)
                (loss_sum / n).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    acc = None if arm.startswith("hand") else fb.Accumulator(model, opt, **options[arm])

    def fullbatch_pass() -> None:
        assert acc is not None
        for window in acc.windows(data):
            for micro in window:
                shapes.add(tuple(micro["input_ids"].shape))
                window.backward(*_loss(model, micro))
            window.step()

    one_pass = hand_pass if acc is None else fullbatch_pass
    times, counts = [], []
    with _backend(backend, cpu):
        _warm_up(model, device)
        for _ in range(2):  # new shapes, then the same shapes again
            _sync(device)
            start = time.perf_counter()
            one_pass()
            _sync(device)
            times.append(time.perf_counter() - start)
            counts.append(len(shapes))
    if acc is not None:
        acc.close()
    real = sum(sum(w) for w in data_lengths)
    return {
        "arm": arm,
        "backend": backend,
        "params": params,
        "new_s": times[0],
        "seen_s": times[1],
        "new_tps": real / times[0],
        "seen_tps": real / times[1],
        "shapes": counts[0],
        "windows": windows,
        "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
    }


def _warm_up(model: Any, device: torch.device) -> None:
    """CUDA and library set-up outside the timed passes (one tiny forward and backward)."""
    ids = torch.full((1, 4), 3, device=device)
    model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float().sum().backward()
    model.zero_grad(set_to_none=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _backend(name: str, cpu: bool) -> Any:
    from contextlib import nullcontext

    from torch.nn.attention import SDPBackend, sdpa_kernel

    if cpu:
        return nullcontext()
    chosen = {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
        "flash": SDPBackend.FLASH_ATTENTION,
    }[name]
    return sdpa_kernel([chosen])


# -- the table ---------------------------------------------------------------------------------


def _child(
    arms: tuple[str, ...], backend: str, windows: int, timeout: float, cpu: bool = False
) -> list[dict]:
    """Arms in a fresh process (in turn): their shapes are new to every per-shape cache."""
    command = [sys.executable, __file__, "--child", ",".join(arms), "--backend", backend,
               "--windows", str(windows), *(["--cpu"] if cpu else [])]  # fmt: skip
    failed = [{"arm": arm, "backend": backend, "windows": windows} for arm in arms]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [dict(r, error=f"over {timeout:.0f} s") for r in failed]
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or len(results) != len(arms):
        last = (done.stderr.strip().splitlines() or ["no output"])[-1][:160]
        ran = {r["arm"] for r in results}
        return results + [dict(r, error=last) for r in failed if r["arm"] not in ran]
    return results


def measure(
    *,
    cpu: bool,
    windows: int,
    backend_windows: int,
    timeout: float = 240,
    processes: bool | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every arm with cuDNN attention, each in its own process; then each backend on two arms,
    one process per backend. On the CPU (``processes`` False by default there): every arm in
    this process, default attention, no backends."""
    if processes is None:
        processes = not cpu
    if not processes:
        arms = [run_arm(arm, cpu=cpu, windows=windows, backend="math") for arm in ARMS]
        return arms, []
    first = "math" if cpu else "cudnn"
    arms = [r for arm in ARMS for r in _child((arm,), first, windows, timeout, cpu)]
    backends = BACKENDS if not cpu else ("math",)
    by_backend = [
        r for b in backends for r in _child(BACKEND_ARMS, b, backend_windows, timeout, cpu)
    ]
    return arms, by_backend


def table(arms: list[dict[str, Any]], by_backend: list[dict[str, Any]]) -> Iterator[str]:
    head = next((r for r in arms if "params" in r), None)
    if head is not None and head["params"] < 1e6:
        yield (
            f"Shape churn, CPU smoke run: a {head['params'] / 1e3:.0f}k-parameter Llama, "
            f"{head['windows']} windows of {CPU['rows']} rows, budgets {CPU['tokens']} and "
            f"multiple {CPU['m']} in place of the GPU's (3200, 16384) and 64: no timing claim"
        )
    elif head is not None:
        yield (
            f"Shape churn: a {head['params'] / 1e6:.0f}M-parameter Llama, bf16, "
            f"{head['windows']} windows of {ROWS} rows (lengths 16..2048, median 300), each "
            "arm in a fresh process; first pass: shapes new, second: the same windows again "
            f"({head['backend']} attention)"
        )
    yield ""
    yield "| arm | new s | seen s | real tokens/s new / seen | shapes |"
    yield "|---|---:|---:|---:|---:|"
    for r in arms:
        yield _line(ARMS[r["arm"]], r)
    if by_backend:
        yield ""
        yield f"| attention backend, arm ({by_backend[0].get('windows', '?')} windows) | new s " \
              "| seen s | real tokens/s new / seen | shapes |"  # fmt: skip
        yield "|---|---:|---:|---:|---:|"
        for r in by_backend:
            yield _line(f"{r['backend']}, {ARMS[r['arm']]}", r)


def _line(name: str, r: dict[str, Any]) -> str:
    if "error" in r:
        return f"| {name} | n/a | n/a | {r['error']} | |"
    return (
        f"| {name} | {r['new_s']:.2f} | {r['seen_s']:.2f} | "
        f"{r['new_tps'] / 1e3:.1f}k / {r['seen_tps'] / 1e3:.1f}k | {r['shapes']} |"
    )


def verdict(arms: list[dict[str, Any]], cpu: bool) -> tuple[bool, str]:
    """Every arm ran and trained finite; the buckets met fewer shapes than exact widths."""
    failed = [r["arm"] for r in arms if "error" in r or not r.get("finite", False)]
    if failed:
        return False, f"arms that did not run: {failed}"
    shapes = {r["arm"]: r["shapes"] for r in arms}
    pairs = [("sort", "sort64"), ("tokens3200", "tokens3200_64"), ("tokens16384", "tokens16384_64")]
    fewer = all(shapes[b] <= shapes[a] for a, b in pairs)
    seen = {r["arm"]: r["seen_s"] for r in arms}
    summary = ", ".join(f"{a} {shapes[a]} -> {shapes[b]}" for a, b in pairs)
    timing = "" if cpu else f"; sort_rows seen {seen['sort']:.2f} s vs x64 {seen['sort64']:.2f} s"
    return fewer, f"{len(arms)} arms ran; shapes exact -> x64: {summary}{timing} (table below)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="a tiny smoke run on the CPU")
    parser.add_argument("--windows", type=int, default=8, help="windows per pass and arm")
    parser.add_argument("--backend-windows", type=int, default=3, help="per backend and arm")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # arms, comma-separated
    parser.add_argument("--backend", choices=BACKENDS, default="cudnn", help=argparse.SUPPRESS)
    parser.add_argument(
        "--processes", action="store_true", help="with --cpu: each arm in its own process too"
    )
    args = parser.parse_args(argv)
    if args.child:
        for arm in args.child.split(","):
            result = run_arm(arm, cpu=args.cpu, windows=args.windows, backend=args.backend)
            print(json.dumps(result), flush=True)
        return 0
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_shapes: no CUDA device here; run it on a GPU, or with --cpu for the smoke run.")
        return 2
    windows = 1 if args.cpu else args.windows
    arms, by_backend = measure(
        cpu=args.cpu, windows=windows, backend_windows=args.backend_windows,
        processes=True if args.processes else None,
    )  # fmt: skip
    ok, detail = verdict(arms, args.cpu)
    print(detail)
    for line in table(arms, by_backend):
        print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

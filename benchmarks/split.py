"""How a window's rows are grouped into micro-batches: time, padding, memory and exactness.

    pip install -e .[bench]
    python benchmarks/split.py --windows 10            # CPU
    python benchmarks/split.py --windows 10 --device cuda

Real variable-length text: docstrings of the Python standard library (read with ``ast``, never
imported), as UTF-8 bytes capped at 512 tokens; windows of 64 rows, each right-padded to its
longest row as a loader yields it; a tiny Llama (~0.9M parameters) built from a config, float32.
Every arm computes one window's gradient from the same parameters (SGD with lr=0, so the
parameters never move and every window is compared at the same point):

  (a) fullbatch, micro_batch_size=8: 8-row micro-batches that keep the window's padding
  (b) the usual hand loop: 8-row micro-batches, each padded to its own longest row, loss_sum / N
  (c) Hugging Face Accelerate's documented accumulate() on (b)'s micro-batches (loss / K)
  (d) fullbatch, micro_batch_size=8, sort_rows=True
  (e) fullbatch, micro_batch_tokens=8*512
  (f) fullbatch, micro_batch_tokens="auto" with window.run, where a simulated memory limit lets
      at most 8*512 padded tokens through a forward (the first window finds the budget)
  (g) fullbatch, micro_batch_tokens=8*512, pack=True with window.run: rows packed
      first-fit-decreasing into one row per micro-batch; transformers' own attention (sdpa with
      the block mask it builds from position_ids, dense on CPU)
  (h) as (g) with a per-row attention (benchmarks/_packed_arms.py: one causal sdpa call per
      row, cut at cu_seq_lens_q), which computes only the scores each row needs
  (i) --device cuda only, when flash_attn imports: as (g) with attn_implementation=
      "flash_attention_2", whose varlen kernel reads cu_seq_lens_q/k and max_length_q/k

(g)-(i) run the packing check on their first window (a warm-up window, not in the table).
Scores: attention scores computed per head and layer (rows x width^2 padded, n^2 for a packed
row under a dense mask, the sum of squared row lengths per row), over what the rows need.

Arms alternate window by window in one process; the table shows medians over windows.
Gradient error: ||g - g_full|| / ||g_full|| against the whole window in one float32 forward and
backward (same window, same parameters). Peak memory: the window's peak resident set size over
its start (Linux VmHWM, reset per window; glibc's cache is trimmed first) on CPU;
``torch.cuda.max_memory_allocated`` over the start on CUDA.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import importlib.util
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from _packed_arms import register_per_row, scores_needed

import fullbatch as fb
from fullbatch._demo._corpus import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, encode_bytes, read_corpus
from fullbatch._demo._corpus import make_batches as pad_windows

ROWS, MICRO, MAX_LEN = 64, 8, 512
Batch = dict[str, torch.Tensor]
Run = Callable[[Batch, "Tally"], None]
Arm = tuple[Run, torch.optim.Optimizer]


def tiny_llama(seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=MAX_LEN,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


# -- memory ----------------------------------------------------------------------------------


class Memory:
    """Peak memory of one window over its start, in MiB."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._libc = None if self.cuda else ctypes.CDLL("libc.so.6")

    def _rss(self, field: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(f"no {field} in /proc/self/status")

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
            return
        assert self._libc is not None
        self._libc.malloc_trim(0)  # hand freed memory back, so the next window's peak shows
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM, the peak resident set size
        self._base = self._rss("VmRSS:")

    def peak(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return (torch.cuda.max_memory_allocated() - self._base) / 2**20
        return (self._rss("VmHWM:") - self._base) / 2**20


# -- the arms --------------------------------------------------------------------------------


class Tally:
    """What one arm computed in one window."""

    def __init__(self) -> None:
        self.computed = 0
        self.micro_batches = 0
        self.scores = 0

    def saw(self, micro: Batch, scores: int | None = None) -> None:
        rows, width = micro["input_ids"].shape
        self.computed += rows * width
        self.micro_batches += 1
        self.scores += rows * width * width if scores is None else scores


def logits(model: torch.nn.Module, micro: Batch) -> torch.Tensor:
    return model(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"]).logits


def own_width(window: Batch) -> list[Batch]:
    """(b)/(c): consecutive 8-row micro-batches, each cut to its own longest row."""
    out = []
    for i in range(0, window["input_ids"].shape[0], MICRO):
        micro = {k: v[i : i + MICRO] for k, v in window.items()}
        width = int(micro["attention_mask"].sum(1).max())
        out.append({k: v[:, :width] for k, v in micro.items()})
    return out


def fullbatch_arm(model: torch.nn.Module, **options: Any) -> Arm:
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    acc = fb.Accumulator(model, opt, **options)

    def run(window: Batch, tally: Tally) -> None:
        for w in acc.windows([window]):
            for micro in w:
                tally.saw(micro)
                w.backward(*fb.causal_lm_loss(logits(model, micro), micro["labels"]))
            w.step()

    return run, opt


def hand_loop(model: torch.nn.Module) -> Arm:
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def run(window: Batch, tally: Tally) -> None:
        n = fb.count_tokens(window["labels"])
        for micro in own_width(window):
            tally.saw(micro)
            loss_sum, _ = fb.causal_lm_loss(logits(model, micro), micro["labels"])
            (loss_sum / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return run, opt


def accelerate_arm(model: torch.nn.Module, device: torch.device) -> Arm:
    from accelerate import Accelerator

    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    accelerator = Accelerator(gradient_accumulation_steps=ROWS // MICRO, cpu=device.type == "cpu")
    prepared, prepared_opt = accelerator.prepare(model, opt)

    def run(window: Batch, tally: Tally) -> None:
        for micro in own_width(window):  # Accelerate's documented loop
            tally.saw(micro)
            with accelerator.accumulate(prepared):
                outputs = prepared(**micro)
                loss = outputs.loss
                accelerator.backward(loss)
                prepared_opt.step()
                prepared_opt.zero_grad()

    return run, opt


def grad_of(p: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()


def record_grads(opt: torch.optim.Optimizer, into: list[list[torch.Tensor]]) -> None:
    def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        into.append([grad_of(p) for g in opt.param_groups for p in g["params"]])

    opt.register_step_pre_hook(hook)


def full_batch_grads(model: torch.nn.Module, window: Batch) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss_sum, n = fb.causal_lm_loss(logits(model, window), window["labels"])
    (loss_sum / n).backward()
    grads = [grad_of(p) for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def rel_norm(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    pairs = zip(got, want, strict=True)
    diff = sum(float((g.double() - w.double()).square().sum()) for g, w in pairs)
    return (diff / sum(float(w.double().square().sum()) for w in want)) ** 0.5


# -- main ------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def auto_arm(model: torch.nn.Module, fits: int, first: dict[str, float]) -> Arm:
    """(f) ``micro_batch_tokens="auto"`` where at most ``fits`` padded tokens fit in a forward.

    The memory limit is simulated (a forward pre-hook raises ``torch.OutOfMemoryError`` above
    ``fits`` tokens), so the CPU run shows what a GPU would do: the first window starts whole,
    halves until a micro-batch fits, and later windows reuse the size. ``first`` receives the
    first window's seconds and retries.
    """

    def limit(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and ids.numel() > fits:
            raise torch.OutOfMemoryError(f"{ids.numel()} tokens > {fits} (simulated)")

    model.register_forward_pre_hook(limit, with_kwargs=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    acc = fb.Accumulator(model, opt, micro_batch_tokens="auto")

    def run(window: Batch, tally: Tally) -> None:
        def step(micro: Batch) -> Any:
            tally.saw(micro)
            return fb.causal_lm_loss(logits(model, micro), micro["labels"])

        start = time.perf_counter()
        for w in acc.windows([window]):
            stats = w.run(step)
        if not first:
            first.update(seconds=time.perf_counter() - start, retries=stats.retries)
            first["budget"] = acc.micro_batch_tokens or 0

    return run, opt


def packed_arm(model: torch.nn.Module, attention: str) -> Arm:
    """(g)-(i): ``pack=True`` with ``window.run`` and the documented packed call."""
    from _packed_arms import packed_scores

    model.set_attn_implementation(attention)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    acc = fb.Accumulator(model, opt, micro_batch_tokens=MICRO * MAX_LEN, pack=True)

    def run(window: Batch, tally: Tally) -> None:
        def step(micro: Batch) -> Any:
            tally.saw(micro, packed_scores(micro, per_row=attention != "sdpa"))
            out = model(**{k: v for k, v in micro.items() if k != "labels"})
            return fb.causal_lm_loss(out.logits, micro["labels"])

        for w in acc.windows([window]):
            w.run(step)

    return run, opt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--windows", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=1, help="windows run but not counted")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (torch)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    n_windows = args.windows + args.warmup
    corpus = read_corpus(
        n_windows * ROWS, seed=args.seed, encode=lambda t: encode_bytes(t, max_length=MAX_LEN)
    )
    windows = [
        {k: v.to(device) for k, v in w.items()}
        for w in pad_windows(corpus.rows, batch_size=ROWS, pad_id=PAD_ID)
    ]
    base = tiny_llama(args.seed).to(device)
    base.eval()  # no dropout: every arm computes the same function
    first: dict[str, float] = {}
    arms: dict[str, Arm] = {
        "(a) micro_batch_size=8": fullbatch_arm(copy.deepcopy(base), micro_batch_size=MICRO),
        "(b) hand loop, own width": hand_loop(copy.deepcopy(base)),
        "(c) Accelerate accumulate()": accelerate_arm(copy.deepcopy(base), device),
        "(d) size=8, sort_rows=True": fullbatch_arm(
            copy.deepcopy(base), micro_batch_size=MICRO, sort_rows=True
        ),
        "(e) micro_batch_tokens=8*512": fullbatch_arm(
            copy.deepcopy(base), micro_batch_tokens=MICRO * MAX_LEN
        ),
        "(f) tokens='auto', 4096 fit": auto_arm(copy.deepcopy(base), MICRO * MAX_LEN, first),
        "(g) pack=True, sdpa": packed_arm(copy.deepcopy(base), "sdpa"),
        "(h) pack=True, per-row attn": packed_arm(copy.deepcopy(base), register_per_row()),
    }
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        arms["(i) pack=True, flash varlen"] = packed_arm(copy.deepcopy(base), "flash_attention_2")
    grads: dict[str, list[list[torch.Tensor]]] = {name: [] for name in arms}
    for name, (_, opt) in arms.items():
        record_grads(opt, grads[name])
    rows: dict[str, dict[str, list[float]]] = {
        name: {k: [] for k in ("s", "cpu", "real", "mb", "mem", "err", "scores")} for name in arms
    }
    memory = Memory(device)
    for index, window in enumerate(windows):
        real = int(window["attention_mask"].sum())
        needed = scores_needed(window["attention_mask"].sum(1).tolist())
        want = full_batch_grads(base, window) if index >= args.warmup else None
        order = list(arms) if index % 2 == 0 else list(reversed(arms))  # alternate the order
        for name in order:
            tally = Tally()
            memory.start()
            sync(device)
            start, cpu_start = time.perf_counter(), time.process_time()
            arms[name][0](window, tally)
            sync(device)
            seconds = time.perf_counter() - start
            cpu = time.process_time() - cpu_start
            peak = memory.peak()
            if want is None:
                continue
            row = rows[name]
            row["s"].append(seconds)
            row["cpu"].append(cpu)
            row["real"].append(real / tally.computed)
            row["scores"].append(tally.scores / needed)
            row["mb"].append(tally.micro_batches)
            row["mem"].append(peak)
            row["err"].append(rel_norm(grads[name][-1], want))
        print(f"window {index + 1}/{n_windows} done", flush=True)

    params = sum(p.numel() for p in base.parameters())
    print(
        f"\n{args.windows} windows of {ROWS} rows (+{args.warmup} warm-up), standard-library "
        f"docstrings as bytes capped at {MAX_LEN}, corpus {corpus.digest}; tiny Llama "
        f"{params / 1e6:.2f}M parameters, float32, {device}"
        + (f", {args.threads} thread(s)" if device.type == "cpu" else "")
        + f"; seed {args.seed}; medians over windows"
    )
    mem_name = "peak MiB (RSS)" if device.type == "cpu" else "peak MiB (CUDA)"
    header = (
        f"{'arm':30s} {'s/window':>9s} {'vs (b)':>7s} {'CPU s':>7s} {'vs (b)':>7s} "
        f"{'real/computed':>14s} {'scores/needed':>14s} "
        f"{'micro-batches':>14s} {mem_name:>15s} {'grad error':>11s}"
    )
    print(header)
    print("-" * len(header))
    ref_time = statistics.median(rows["(b) hand loop, own width"]["s"])
    ref_cpu = statistics.median(rows["(b) hand loop, own width"]["cpu"])
    for name, row in rows.items():
        t, c = statistics.median(row["s"]), statistics.median(row["cpu"])
        print(
            f"{name:30s} {t:9.3f} {ref_time / t:6.2f}x {c:7.3f} {ref_cpu / c:6.2f}x "
            f"{statistics.median(row['real']):13.0%} {statistics.median(row['scores']):13.2f}x "
            f"{statistics.median(row['mb']):14.1f} {statistics.median(row['mem']):15.1f} "
            f"{statistics.median(row['err']):11.1e}"
        )
    print(
        f"(f) 'auto' found a budget of {first['budget']:.0f} tokens on its first window "
        f"(warm-up included) in {first['retries']:.0f} retries, {first['seconds']:.2f} s; "
        "the row above is the later windows, which reuse it. The memory limit is simulated "
        "(OOM raised above 8*512 tokens per forward)."
    )
    print(
        "s/window: wall clock; CPU s: this process's CPU time (less sensitive to other load "
        "on the machine). vs (b): how many times faster than the hand loop. grad error: "
        "||g - g_full|| / ||g_full|| against the whole window in one forward/backward "
        "(float32)."
    )


if __name__ == "__main__":
    main()

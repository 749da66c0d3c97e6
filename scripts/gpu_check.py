"""What the CPU suite cannot show, checked on one CUDA device in a few minutes.

    python scripts/gpu_check.py                  # on a CUDA machine: every row
    python scripts/gpu_check.py --cpu            # the rows that run on a CPU (a smoke test)
    python scripts/gpu_check.py --rows nccl,syncs

Each row trains a small causal LM through ``fb.Accumulator`` and compares it with a full-batch
reference (float64, or the hand-written loop where rounding is the point):

  nccl   NCCL with one process: a world-size-1 process group and DDP; 3 windows against the
         float64 full batch (``--cpu``: gloo)
  bf16   bf16 autocast: the accumulated step's error against float64 stays within 3x the
         error of the bf16 full-batch step itself
  fp16   fp16 autocast with GradScaler(init_scale=2**28): real infs in the first windows;
         fullbatch skips no more windows than the hand loop, leaves parameters untouched on a
         skip, and ends as close to float64 as the hand loop (3x)
  oom    micro_batch_size="auto" on a real CUDA out-of-memory error (memory filled so that the
         whole window does not fit): re-runs, a smaller size, the float64 full-batch step
         (``--cpu``: the error is raised by the loss function above a row count)
  syncs  torch.cuda.set_sync_debug_mode("warn"): synchronizing calls per window after the
         first two windows: hand loop, fullbatch plain (<= 1), with a GradScaler (<= 1), with
         counts= (<= 2)  (CUDA only)
  pack   pack=True on a tiny transformers Llama (sdpa; flash_attention_2 in bf16 too when
         flash-attn is installed): the packing check passes, the step equals the padded full
         batch
  speed  peak memory (max_memory_allocated) and median seconds per window against the hand
         loop: within 1.02x memory and 1.05x time (``--cpu``: time only, printed as "info")
  graphs CUDA graphs through ``torch.compile(model, mode="reduce-overhead")`` with
         ``sort_rows`` and ``pad_to_multiple_of=8`` (a graph per bucket): 3 windows equal the
         eager run (1e-4), for fullbatch and for the hand loop on the same micro-batches
         (CUDA only)
  shapes shape churn (``scripts/gpu_shapes.py``): a ~168M-parameter Llama in bf16, windows of
         64 rows of 16..2048 tokens; seconds per pass while shapes are new and once seen, for
         the hand loop (trimmed, x128), ``micro_batch_size=8``, ``sort_rows`` and two token
         budgets with exact widths and ``pad_to_multiple_of=64``, then per sdpa backend; its
         table is printed after this one. Passes when every arm ran and the buckets met no
         more shapes than exact widths (``--cpu``: a tiny model, no timing claim)
  torchtitan  torchtitan's own ``Trainer`` (0.3.0: llama3 debug model, flex attention, one
         process, gradient accumulation 2 by ``global_batch_size``) runs one ``train_step``
         under ``fb.probe(objective="token")``: passes when the probe judges its step right
         (CUDA only; skipped without torchtitan. Written without a CUDA device: not yet run)

Exit status: 0 every row passed or was skipped, 1 some row failed, 2 no CUDA device and no
``--cpu``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import fullbatch as fb

VOCAB, LR = 128, 0.5
Micro = dict[str, torch.Tensor]


@dataclass
class Row:
    name: str
    status: str  # "pass", "FAIL", "skip" or "info" (measured, not judged: --cpu timings)
    detail: str
    table: tuple[str, ...] = ()  # printed after the check table (the shapes row's)


# -- a model, data, references -----------------------------------------------------------------


class TinyLM(nn.Module):
    def __init__(self, vocab: int = VOCAB, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        return self.head(h + self.mlp(h))


def make_model(seed: int = 0, **sizes: int) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(**sizes)


def make_windows(
    n: int, k: int, rows: int, length: int, seed: int = 0, vocab: int = VOCAB
) -> list[list[Micro]]:
    """``n`` windows of ``k`` micro-batches; right padding labelled -100."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        window = []
        for _ in range(k):
            ids = torch.randint(1, vocab, (rows, length), generator=g)
            lengths = torch.randint(length // 4, length + 1, (rows,), generator=g)
            mask = torch.arange(length)[None, :] < lengths[:, None]
            window.append({"input_ids": ids * mask, "labels": ids.masked_fill(~mask, -100)})
        out.append(window)
    return out


def to(window: list[Micro], device: torch.device) -> list[Micro]:
    return [{k: v.to(device) for k, v in m.items()} for m in window]


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double().cpu() for p in model.parameters()])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def reference(
    state: dict[str, torch.Tensor], windows: list[list[Micro]], device: torch.device, **sizes: int
) -> list[torch.Tensor]:
    """Float64 full batch, SGD: the parameters after every window."""
    model = TinyLM(**sizes).double().to(device)
    model.load_state_dict(state)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = []
    for window in windows:
        ids = torch.cat([m["input_ids"] for m in window]).to(device)
        labels = torch.cat([m["labels"] for m in window]).to(device)
        loss_sum, n = fb.causal_lm_loss(model(ids), labels)
        (loss_sum / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(flat(model))
    return out


def autocast(device: torch.device, dtype: torch.dtype | None) -> Any:
    return torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()


def fullbatch_run(
    model: nn.Module,
    forward: Callable[[torch.Tensor], torch.Tensor],
    windows: list[list[Micro]],
    device: torch.device,
    *,
    dtype: torch.dtype | None = None,
    scaler: Any = None,
    **options: Any,
) -> tuple[list[torch.Tensor], list[fb.StepStats]]:
    """The plain fullbatch loop; the parameters and stats after every window."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loader = [m for w in windows for m in to(w, device)]
    params, stats = [], []
    with fb.Accumulator(model, opt, micro_batches=len(windows[0]), scaler=scaler, **options) as acc:
        for window in acc.windows(loader):
            for m in window:
                with autocast(device, dtype):
                    loss = fb.causal_lm_loss(forward(m["input_ids"]), m["labels"])
                window.backward(*loss)
            stats.append(window.step())
            params.append(flat(model))
    return params, stats


def hand_window(
    model: nn.Module,
    forward: Callable[[torch.Tensor], torch.Tensor],
    opt: torch.optim.Optimizer,
    window: list[Micro],
    *,
    device: torch.device,
    dtype: torch.dtype | None = None,
    scaler: Any = None,
) -> None:
    """The loop fullbatch replaces: count up front, backpropagate ``loss_sum / N``."""
    n = sum(fb.count_tokens(m["labels"]) for m in window)
    for m in window:
        with autocast(device, dtype):
            loss_sum, _ = fb.causal_lm_loss(forward(m["input_ids"]), m["labels"])
        loss = loss_sum / n
        (scaler.scale(loss) if scaler is not None else loss).backward()
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    opt.zero_grad(set_to_none=True)


# -- rows ----------------------------------------------------------------------------------------


def row_nccl(device: torch.device) -> Row:
    backend = "nccl" if device.type == "cuda" else "gloo"
    windows = make_windows(3, 3, 4, 32)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            model = make_model().to(device)
            state = {k: v.double().cpu() for k, v in model.state_dict().items()}
            ids = [device.index or 0] if device.type == "cuda" else None
            ddp = nn.parallel.DistributedDataParallel(model, device_ids=ids)
            got, stats = fullbatch_run(ddp, ddp, windows, device)
        finally:
            dist.destroy_process_group()
    ref = reference(state, windows, torch.device("cpu"))
    err = max(rel(g, r) for g, r in zip(got, ref, strict=True))
    ok = err < 1e-5 and not any(s.skipped for s in stats)
    return Row(
        "nccl",
        "pass" if ok else "FAIL",
        f"{backend}, world 1, DDP: max error {err:.1e} vs float64 (< 1e-5)",
    )


def row_bf16(device: torch.device) -> Row:
    windows = make_windows(1, 4, 4, 32)
    model = make_model().to(device)
    state = {k: v.double().cpu() for k, v in model.state_dict().items()}
    start = flat(model)
    (got,), _ = fullbatch_run(model, model, windows, device, dtype=torch.bfloat16)
    whole = make_model().to(device)
    full_window = [{k: torch.cat([m[k] for m in windows[0]]) for k in windows[0][0]}]
    opt = torch.optim.SGD(whole.parameters(), lr=LR)
    hand_window(whole, whole, opt, to(full_window, device), device=device, dtype=torch.bfloat16)
    (ref,) = reference(state, windows, torch.device("cpu"))
    err, band = rel(got - start, ref - start), rel(flat(whole) - start, ref - start)
    ok = err <= 3 * band + 1e-7
    return Row(
        "bf16",
        "pass" if ok else "FAIL",
        f"step error {err:.2e} vs float64; bf16 full batch's own {band:.2e} (<= 3x)",
    )


def row_fp16(device: torch.device) -> Row:
    windows = make_windows(10, 3, 4, 32)
    state = {k: v.double().cpu() for k, v in make_model().state_dict().items()}

    def scaler() -> Any:  # scaled gradients overflow fp16 until the scale has backed off
        return torch.amp.GradScaler(device.type, init_scale=2.0**28)

    model = make_model().to(device)
    got, stats = fullbatch_run(model, model, windows, device, dtype=torch.float16, scaler=scaler())
    skipped = [s.skipped for s in stats]
    before = [flat(make_model()), *got[:-1]]
    untouched = all(torch.equal(a, b) for a, b, s in zip(before, got, skipped, strict=True) if s)
    hand, hand_scaler = make_model().to(device), scaler()
    opt = torch.optim.SGD(hand.parameters(), lr=LR)
    hand_skipped = []
    for window in windows:
        scale = hand_scaler.get_scale()
        hand_window(
            hand,
            hand,
            opt,
            to(window, device),
            device=device,
            dtype=torch.float16,
            scaler=hand_scaler,
        )
        hand_skipped.append(hand_scaler.get_scale() < scale)
    stepped = [w for w, s in zip(windows, skipped, strict=True) if not s]
    ref = reference(state, stepped, torch.device("cpu"))[-1] if stepped else flat(make_model())
    err, band = rel(got[-1], ref), rel(flat(hand), ref)
    ok = 0 < sum(skipped) <= sum(hand_skipped) and untouched and stepped and err <= 3 * band + 1e-6
    return Row(
        "fp16",
        "pass" if ok else "FAIL",
        f"skipped {sum(skipped)} of {len(windows)} windows (hand loop {sum(hand_skipped)}), "
        f"parameters untouched on skips: {untouched}; error {err:.2e} vs float64, hand {band:.2e}",
    )


def row_oom(device: torch.device) -> Row:
    sizes = {"vocab": 4096, "width": 64} if device.type == "cuda" else {}
    vocab = sizes.get("vocab", VOCAB)
    (window,) = make_windows(1, 1, 32, 128 if device.type == "cuda" else 16, vocab=vocab)
    item = window[0]
    state = {k: v.double().cpu() for k, v in make_model(**sizes).state_dict().items()}
    limit = 8  # --cpu: rows above this "do not fit"
    model = make_model(**sizes).to(device)

    def loss(micro: Micro) -> Any:
        if device.type != "cuda" and micro["input_ids"].shape[0] > limit:
            raise torch.OutOfMemoryError("simulated: more rows than fit")
        return fb.causal_lm_loss(model(micro["input_ids"]), micro["labels"])

    filler = _fill_memory(model, item, device) if device.type == "cuda" else None
    try:
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        with fb.Accumulator(model, opt, micro_batch_size="auto") as acc:
            for w in acc.windows([{k: v.to(device) for k, v in item.items()}]):
                stats = w.run(loss)
            size = acc.micro_batch_size
    finally:
        del filler
        if device.type == "cuda":
            torch.cuda.empty_cache()
    (ref,) = reference(state, [[item]], torch.device("cpu"), **sizes)
    err = rel(flat(model), ref)
    ok = stats.retries >= 1 and size is not None and size < 32 and err < 1e-5
    kind = "real CUDA OOM" if device.type == "cuda" else "simulated OOM"
    return Row(
        "oom",
        "pass" if ok else "FAIL",
        f"{kind}: {stats.retries} re-run(s), 32 rows -> {size}; error {err:.1e} vs float64",
    )


def _fill_memory(model: nn.Module, item: Micro, device: torch.device) -> torch.Tensor:
    """Leave free only what a quarter of the window needs (measured), not the whole window."""

    def peak(rows: int) -> int:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        micro = {k: v[:rows].to(device) for k, v in item.items()}
        loss_sum, _ = fb.causal_lm_loss(model(micro["input_ids"]), micro["labels"])
        loss_sum.backward()
        model.zero_grad(set_to_none=True)
        return torch.cuda.max_memory_allocated() - base

    rows = item["input_ids"].shape[0]
    quarter, whole = peak(rows // 4), peak(rows)
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    slack = (quarter + whole) // 2
    return torch.empty(max(free - slack - (64 << 20), 0), dtype=torch.uint8, device=device)


def row_syncs(device: torch.device) -> Row:
    if device.type != "cuda":
        return Row("syncs", "skip", "needs CUDA (the CPU suite counts reads on a fake device)")
    windows = [to(w, device) for w in make_windows(5, 3, 4, 32)]
    counts = {"tokens": lambda m: fb.count_tokens(m["labels"])}

    def counted(run: Callable[[], Iterator[None]]) -> list[int]:
        per_window = []
        torch.cuda.set_sync_debug_mode("warn")
        try:
            steps = run()
            while True:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    if next(steps, False) is False:
                        break
                per_window.append(sum("synchroniz" in str(w.message) for w in caught))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return per_window[2:]  # after the one-time checks of the first windows

    def hand() -> Iterator[None]:
        model = make_model().to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for w in windows:
            hand_window(model, model, opt, w, device=device)
            yield None

    def ours(**options: Any) -> Callable[[], Iterator[None]]:
        def run() -> Iterator[None]:
            model = make_model().to(device)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            loader = [m for w in windows for m in w]
            acc = fb.Accumulator(model, opt, micro_batches=3, max_grad_norm=1.0, **options)
            for window in acc.windows(loader):
                for m in window:
                    loss_sum, n = fb.causal_lm_loss(model(m["input_ids"]), m["labels"])
                    if options.get("counts"):
                        window.backward(loss_sum / window.totals["tokens"])
                    else:
                        window.backward(loss_sum, n)
                window.step()
                yield None

        return run

    found = {
        "hand": counted(hand),
        "plain": counted(ours()),
        "scaler": counted(ours(scaler=torch.amp.GradScaler("cuda"))),
        "counts": counted(ours(counts=counts)),
    }
    ok = max(found["plain"]) <= 1 and max(found["scaler"]) <= 1 and max(found["counts"]) <= 2
    shown = ", ".join(f"{k} {max(v)}" for k, v in found.items())
    return Row("syncs", "pass" if ok else "FAIL", f"synchronizations per window: {shown}")


def _attention(model: Any, impl: str) -> None:
    """Select the attention kernel (``set_attn_implementation`` is transformers 5's; older
    Llamas read the config at every forward)."""
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None:
        setter(impl)
    else:
        model.config._attn_implementation = impl


def row_pack(device: torch.device) -> Row:
    try:
        import transformers
    except ImportError:
        return Row("pack", "skip", "transformers is not installed (pip install fullbatch[hf])")
    lengths = [12, 5, 20, 3, 17, 9, 24, 7, 14, 2]
    g = torch.Generator().manual_seed(0)
    mask = (torch.arange(24) < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(3, 64, mask.shape, generator=g) * mask
    item = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    on = {k: v.to(device) for k, v in item.items()}
    impls = [("sdpa", torch.float32, 1e-5)]
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        impls.append(("flash_attention_2", torch.bfloat16, 3e-2))
    details, ok = [], True
    for impl, dtype, tol in impls:
        config = transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        )  # fmt: skip
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).to(device, dtype)
        _attention(model, impl)
        # The reference: the padded full batch in float32 with sdpa, its own gradient.
        padded = transformers.LlamaForCausalLM(config).to(device)
        _attention(padded, "sdpa")
        padded.load_state_dict(model.state_dict())
        logits = padded(input_ids=on["input_ids"], attention_mask=on["attention_mask"]).logits
        loss_sum, n = fb.causal_lm_loss(logits, on["labels"])
        (loss_sum / n).backward()
        want = torch.cat([p.grad.reshape(-1) for p in padded.parameters()])
        got: list[torch.Tensor] = []

        def loss(micro: Micro, model: nn.Module = model) -> Any:
            logits = model(**{k: v for k, v in micro.items() if k != "labels"}).logits
            return fb.causal_lm_loss(logits, micro["labels"])

        opt = torch.optim.SGD(model.parameters(), lr=LR)
        with fb.Accumulator(model, opt, micro_batch_tokens=48, pack=True) as acc:
            acc.register_window_hook(partial(_keep_grads, model, got))
            for w in acc.windows([on]):
                stats = w.run(loss)  # the packing check runs on this first window
        err = rel(got[0].double(), want.double()) if got else float("nan")
        ok = ok and err < tol and not stats.skipped
        details.append(
            f"{impl} {str(dtype)[6:]}: {stats.micro_batches} packed micro-batches, gradient "
            f"error {err:.1e} vs the padded float32 full batch (< {tol:g})"
        )
    return Row("pack", "pass" if ok else "FAIL", "; ".join(details))


def _keep_grads(model: nn.Module, into: list[torch.Tensor]) -> None:
    """A window hook: keep the window's normalized gradient."""
    into.append(
        torch.cat([p.grad.float().reshape(-1) for p in model.parameters() if p.grad is not None])
    )


def row_speed(device: torch.device) -> Row:
    cuda = device.type == "cuda"
    sizes = {"vocab": 8192, "width": 512} if cuda else {"vocab": 256, "width": 64}
    windows = [
        to(w, device)
        for w in make_windows(4, 8, 8 if cuda else 2, 256 if cuda else 64, vocab=sizes["vocab"])
    ]
    hand_model, our_model = make_model(**sizes).to(device), make_model(**sizes).to(device)
    hand_opt = torch.optim.AdamW(hand_model.parameters(), lr=1e-3)
    our_opt = torch.optim.AdamW(our_model.parameters(), lr=1e-3)
    acc = fb.Accumulator(our_model, our_opt, micro_batches=8)

    def ours(window: list[Micro]) -> None:
        for w in acc.windows(window):
            for m in w:
                w.backward(*fb.causal_lm_loss(our_model(m["input_ids"]), m["labels"]))
            w.step()

    def hand(window: list[Micro]) -> None:
        hand_window(hand_model, hand_model, hand_opt, window, device=device)

    times: dict[str, list[float]] = {"hand": [], "fullbatch": []}
    peaks: dict[str, int] = {}
    arms = {"hand": hand, "fullbatch": ours}
    for rep in range(14):
        order = list(arms) if rep % 2 == 0 else list(arms)[::-1]
        for name in order:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            arms[name](windows[rep % len(windows)])
            if cuda:
                torch.cuda.synchronize()
                peaks[name] = max(peaks.get(name, 0), torch.cuda.max_memory_allocated())
            if rep >= 4:
                times[name].append(time.perf_counter() - start)
    acc.close()
    hand_s, ours_s = statistics.median(times["hand"]), statistics.median(times["fullbatch"])
    ratio = ours_s / hand_s
    if not cuda:  # measured, not judged: a shared CPU's timings are no check
        return Row(
            "speed",
            "info",
            f"time only: {ours_s * 1e3:.1f} ms vs hand {hand_s * 1e3:.1f} ms ({ratio:.3f}x)",
        )
    memory = peaks["fullbatch"] / peaks["hand"]
    ok = memory <= 1.02 and ratio <= 1.05
    return Row(
        "speed",
        "pass" if ok else "FAIL",
        f"peak memory {peaks['fullbatch'] / 2**20:.1f} MiB vs hand "
        f"{peaks['hand'] / 2**20:.1f} MiB ({memory:.3f}x); {ours_s * 1e3:.2f} ms vs "
        f"{hand_s * 1e3:.2f} ms per window ({ratio:.3f}x)",
    )


def _graph_windows(device: torch.device) -> list[Micro]:
    """3 windows of 8 rows padded to 32 tokens, right padding with a mask."""
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(3):
        lengths = torch.randint(2, 33, (8,), generator=g)
        mask = (torch.arange(32)[None, :] < lengths[:, None]).long()
        ids = torch.randint(1, VOCAB, (8, 32), generator=g) * mask
        item = {
            "input_ids": ids,
            "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100),
        }
        out.append({k: v.to(device) for k, v in item.items()})
    return out


def row_graphs(device: torch.device) -> Row:
    if device.type != "cuda":
        return Row("graphs", "skip", "needs CUDA (torch.compile(mode='reduce-overhead'))")
    windows = _graph_windows(device)
    options = {"micro_batch_size": 2, "sort_rows": True, "pad_to_multiple_of": 8}

    def run(graphs: bool, hand: bool) -> torch.Tensor:
        torch._dynamo.reset()
        model = make_model().to(device)
        forward = torch.compile(model, mode="reduce-overhead") if graphs else model
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        with fb.Accumulator(model, opt, **options) as acc:
            for window in acc.windows(windows):
                if hand:  # the same micro-batches, the loop fullbatch replaces
                    micros = list(window)
                    window.discard()
                    hand_window(model, forward, opt, micros, device=device)
                    continue
                for m in window:
                    window.backward(*fb.causal_lm_loss(forward(m["input_ids"]), m["labels"]))
                window.step()
        return flat(model)

    errors = {}
    for name, hand in (("fullbatch", False), ("hand loop", True)):
        errors[name] = rel(run(True, hand), run(False, hand))
    ok = errors["fullbatch"] <= 1e-4
    shown = ", ".join(f"{name} {err:.1e}" for name, err in errors.items())
    return Row(
        "graphs", "pass" if ok else "FAIL", f"reduce-overhead vs eager after 3 windows: {shown}"
    )


def row_shapes(device: torch.device) -> Row:
    if importlib.util.find_spec("transformers") is None:
        return Row("shapes", "skip", "transformers is not installed (pip install fullbatch[hf])")
    import gpu_shapes  # beside this script

    cpu = device.type != "cuda"
    arms, by_backend = gpu_shapes.measure(cpu=cpu, windows=1 if cpu else 8, backend_windows=3)
    ok, detail = gpu_shapes.verdict(arms, cpu)
    return Row(
        "shapes", "pass" if ok else "FAIL", detail, tuple(gpu_shapes.table(arms, by_backend))
    )


def _torchtitan_assets(folder: str) -> tuple[str, str]:
    """A word-level tokenizer (``tokenizers``, a torchtitan dependency) and a JSON-lines text
    dataset in ``folder``: torchtitan's wheel ships neither its test tokenizer nor c4_test."""
    import json
    import os

    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(1000)]
    vocab = {w: i for i, w in enumerate(["<unk>", "<|begin_of_text|>", "<|end_of_text|>", *words])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tok_dir, data_dir = os.path.join(folder, "tokenizer"), os.path.join(folder, "data")
    os.makedirs(tok_dir)
    os.makedirs(data_dir)
    tokenizer.save(os.path.join(tok_dir, "tokenizer.json"))
    special = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w") as f:
        json.dump(special, f)
    g = torch.Generator().manual_seed(0)
    with open(os.path.join(data_dir, "train.json"), "w") as f:
        for _ in range(64):
            n = int(torch.randint(8, 200, (1,), generator=g))
            ids = torch.randint(len(words), (n,), generator=g).tolist()
            f.write(json.dumps({"text": " ".join(words[i] for i in ids)}) + "\n")
    return tok_dir, data_dir


def row_torchtitan(device: torch.device) -> Row:
    if device.type != "cuda":
        return Row("torchtitan", "skip", "torchtitan's Trainer needs CUDA (flex attention)")
    if importlib.util.find_spec("torchtitan") is None:
        why = "pip install torchtitan==0.3.0; pip install --no-deps triton"
        return Row("torchtitan", "skip", why)
    import os

    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.models.llama3.config_registry import llama3_debugmodel
    from torchtitan.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        tok_dir, data_dir = _torchtitan_assets(tmp)
        cfg = llama3_debugmodel()
        cfg.hf_assets_path = tok_dir
        cfg.dataloader.dataset_path = data_dir
        cfg.loss = CrossEntropyLoss.Config(global_vocab_size=2048)  # logits out, not chunked
        cfg.training.local_batch_size, cfg.training.global_batch_size = 2, 4  # accumulation 2
        cfg.training.seq_len, cfg.training.steps = 64, 1
        cfg.activation_checkpoint = None
        cfg.training.disable_cuda_graphs = True  # the probe records eager forwards
        cfg.checkpoint.enable = False
        cfg.dump_folder = tmp
        if hasattr(cfg.validator, "enable"):
            cfg.validator.enable = False
        env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "localhost",
               "MASTER_PORT": str(29500 + os.getpid() % 1000)}  # fmt: skip
        os.environ.update(env)
        trainer = Trainer(cfg)
        try:
            batches = trainer.batch_generator(trainer.dataloader)
            with fb.probe(objective="token", windows=1) as probe:
                trainer.train_step(batches)
        finally:
            if hasattr(trainer, "close"):
                trainer.close()
            if dist.is_initialized():
                dist.destroy_process_group()
    report = probe.report
    first = report.windows[0] if report.windows else None
    detail = (
        f"torchtitan Trainer.train_step, GA 2: probe {'right' if report.ok else 'WRONG'}"
        + (f", error {first.error:.1e}, {first.micro_batches} micro-batches" if first else "")
        + (f"; {report.problems[0]}" if report.problems else "")
    )
    return Row("torchtitan", "pass" if report.ok else "FAIL", detail)


ROWS: dict[str, Callable[[torch.device], Row]] = {
    "nccl": row_nccl,
    "bf16": row_bf16,
    "fp16": row_fp16,
    "oom": row_oom,
    "syncs": row_syncs,
    "pack": row_pack,
    "speed": row_speed,
    "graphs": row_graphs,
    "shapes": row_shapes,
    "torchtitan": row_torchtitan,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="run the CPU-runnable rows on the CPU")
    parser.add_argument(
        "--rows", default=",".join(ROWS), help=f"comma-separated, of {','.join(ROWS)}"
    )
    args = parser.parse_args(argv)
    names = [n for n in args.rows.split(",") if n]
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {list(ROWS)}")
    if not args.cpu and not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device here (torch.cuda.is_available() is False). Run it on a "
            "CUDA machine, or `python scripts/gpu_check.py --cpu` for the CPU smoke rows."
        )
        return 2
    device = torch.device("cpu") if args.cpu else torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke rows)"
    print(f"fullbatch {fb.__version__}, torch {torch.__version__}, {name}")
    print("| check | result | detail |\n|---|---|---|", flush=True)
    rows = []
    for row_name in names:
        start = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # skip warnings of the fp16 row, transformers'
                row = ROWS[row_name](device)
        except Exception as error:  # a row that crashes is a failed row; the others still run
            row = Row(row_name, "FAIL", f"{type(error).__name__}: {error}".splitlines()[0])
            traceback.print_exc(file=sys.stderr)
        rows.append(row)
        print(
            f"| {row.name} | {row.status} | {row.detail} ({time.perf_counter() - start:.1f} s) |",
            flush=True,
        )
    for row in rows:
        if row.table:
            print("\n".join(("", *row.table)))
    return 1 if any(r.status == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

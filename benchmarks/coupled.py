"""Contrastive training with in-batch negatives: exact accumulation vs the alternatives.

    pip install -e .[bench]
    python benchmarks/coupled.py --windows 5            # CPU
    python benchmarks/coupled.py --windows 5 --device cuda

Real sentence pairs: from docstrings of the Python standard library (read with ``ast``, never
imported), the summary line as the query and the next paragraph as its document, UTF-8 bytes
capped at 48 (query) and 96 (document) tokens. A tiny BERT (2 layers, hidden 64) built from a
transformers config, mean-pooled, shared by queries and documents (what sentence-transformers'
losses take), float32, no dropout so that every arm can be compared with the full batch.
Loss: multiple-negatives ranking (InfoNCE, cosine similarity x 20, query to document), mean
over the global batch of 256 pairs. Every arm computes one window's gradient from the same
parameters (SGD with lr=0):

  (a) the full batch in one forward and one backward
  (b) fullbatch window.run_coupled, micro-batches of 32 rows
  (c) the naive loop: the same loss inside each 32-row micro-batch (31 negatives, not 255)
  (d) sentence-transformers' CachedMultipleNegativesRankingLoss, mini_batch_size=32

Arms alternate window by window in one process ((a) first, the others in an order rotated
per window); the table shows medians over windows, of wall time and of this process's CPU time
(the steadier of the two on a shared machine). Peak memory: over the window's start (Linux
VmHWM, reset per window) on CPU, ``torch.cuda.max_memory_allocated`` on CUDA. Gradient
error: ||g - g_a|| / ||g_a||.
"""

from __future__ import annotations

import argparse
import ast
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from split import Memory  # the same peak-memory measurement as benchmarks/split.py
from torch import nn

import fullbatch as fb
from fullbatch._demo._arms import relative_error
from fullbatch._demo._corpus import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, source_files, stdlib_root

ROWS, MICRO, Q_LEN, D_LEN, SCALE = 256, 32, 48, 96, 20.0
Batch = dict[str, torch.Tensor]


# -- data ------------------------------------------------------------------------------------


def sentence_pairs(n: int, seed: int) -> list[tuple[str, str]]:
    """``n`` (summary line, next paragraph) pairs from standard-library docstrings."""
    files = source_files(stdlib_root())
    random.Random(seed).shuffle(files)
    out: list[tuple[str, str]] = []
    for path in files:
        try:
            tree = ast.parse(Path(path).read_bytes())
        except (OSError, SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.ClassDef):
                doc = ast.get_docstring(node, clean=True) or ""
                parts = [p.strip() for p in doc.split("\n\n") if p.strip()]
                if len(parts) >= 2 and len(parts[0]) >= 10 and len(parts[1]) >= 20:
                    out.append((parts[0].split("\n")[0], " ".join(parts[1].split())))
                    if len(out) == n:
                        return out
    raise RuntimeError(f"only {len(out)} sentence pairs found, {n} needed")


def tokens(texts: list[str], length: int) -> Batch:
    ids = torch.full((len(texts), length), PAD_ID, dtype=torch.long)
    for i, text in enumerate(texts):
        row = [BOS_ID, *text.encode()[: length - 2], EOS_ID]
        ids[i, : len(row)] = torch.tensor(row)
    return {"input_ids": ids, "attention_mask": (ids != PAD_ID).long()}


def windows(count: int, device: torch.device) -> list[dict[str, Batch]]:
    pairs = sentence_pairs(count * ROWS, seed=0)
    out = []
    for w in range(count):
        chunk = pairs[w * ROWS : (w + 1) * ROWS]
        q = tokens([a for a, _ in chunk], Q_LEN)
        d = tokens([b for _, b in chunk], D_LEN)
        out.append(
            {
                "q_ids": q["input_ids"].to(device),
                "q_mask": q["attention_mask"].to(device),
                "d_ids": d["input_ids"].to(device),
                "d_mask": d["attention_mask"].to(device),
            }
        )
    return out


# -- model -----------------------------------------------------------------------------------


class Encoder(nn.Module):
    """A tiny BERT, mean-pooled over real tokens."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import BertConfig, BertModel

        config = BertConfig(
            vocab_size=VOCAB_SIZE,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=128,
            pad_token_id=PAD_ID,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        self.bert = BertModel(config, add_pooling_layer=False)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        hidden = self.bert(input_ids=ids, attention_mask=mask).last_hidden_state
        m = mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * m).sum(1) / m.sum(1).clamp(min=1)


class SentenceModel(nn.Sequential):
    """The encoder as sentence-transformers' losses call it: features -> sentence_embedding."""

    def forward(self, features: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:  # type: ignore[override]
        emb = self[0](features["input_ids"], features["attention_mask"])
        return {**features, "sentence_embedding": emb}


def encode(model: Encoder) -> Callable[[Batch], tuple[torch.Tensor, torch.Tensor]]:
    return lambda m: (model(m["q_ids"], m["q_mask"]), model(m["d_ids"], m["d_mask"]))


def ranking_loss(reps: Any, rows: slice) -> tuple[torch.Tensor, int]:
    """Multiple-negatives ranking, summed over ``rows``: cosine similarity x SCALE."""
    q, d = (F.normalize(z, dim=-1) for z in reps)
    labels = torch.arange(d.shape[0], device=d.device)[rows]
    return fb.cross_entropy_sum(q[rows] @ d.T * SCALE, labels)


# -- measuring -------------------------------------------------------------------------------


def grads_of(model: nn.Module) -> list[torch.Tensor]:
    return [
        torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
        for p in model.parameters()
    ]


def arms(model: Encoder) -> dict[str, Callable[[dict[str, Batch]], list[torch.Tensor]]]:
    """Each arm: window -> the gradient its optimizer step would use."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    seen: list[list[torch.Tensor]] = []
    opt.register_step_pre_hook(lambda *_: seen.append(grads_of(model)))
    acc = fb.Accumulator(model, opt, micro_batch_size=MICRO)

    def full(window: Batch) -> list[torch.Tensor]:
        loss_sum, n = ranking_loss(encode(model)(window), slice(None))
        (loss_sum / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return seen.pop()

    def coupled(window: Batch) -> list[torch.Tensor]:
        for w in acc.windows([window]):
            w.run_coupled(encode(model), ranking_loss)
        return seen.pop()

    def naive(window: Batch) -> list[torch.Tensor]:
        for w in acc.windows([window]):
            w.run(lambda m: ranking_loss(encode(model)(m), slice(None)))
        return seen.pop()

    out = {
        "(a) full batch, one pass": full,
        "(b) fullbatch run_coupled": coupled,
        "(c) naive per-micro-batch loss": naive,
    }
    try:
        from sentence_transformers.sentence_transformer.losses import (
            CachedMultipleNegativesRankingLoss,
        )
    except ImportError:
        return out
    cached = CachedMultipleNegativesRankingLoss(
        SentenceModel(model), scale=SCALE, mini_batch_size=MICRO
    )

    def st_cached(window: Batch) -> list[torch.Tensor]:
        features = [
            {"input_ids": window["q_ids"], "attention_mask": window["q_mask"]},
            {"input_ids": window["d_ids"], "attention_mask": window["d_mask"]},
        ]
        cached(features, None).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return seen.pop()

    out["(d) sentence-transformers cached MNRL"] = st_cached
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--windows", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = Encoder().to(device)
    data = windows(args.windows + 1, device)
    runs = arms(model)
    memory = Memory(device)
    times: dict[str, list[float]] = {k: [] for k in runs}
    cpu: dict[str, list[float]] = {k: [] for k in runs}
    peaks: dict[str, list[float]] = {k: [] for k in runs}
    errors: dict[str, list[float]] = {k: [] for k in runs}
    for i, window in enumerate(data):
        # The reference first, then the other arms in an order rotated window by window, so
        # that no arm always runs after the full batch's large frees.
        names = list(runs)
        rest = names[1:]
        shift = i % len(rest)
        order = [names[0], *rest[shift:], *rest[:shift]]
        reference: list[torch.Tensor] | None = None
        for name in order:
            run = runs[name]
            memory.start()
            start, start_cpu = time.perf_counter(), time.process_time()
            grads = run(window)
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            elapsed_cpu = time.process_time() - start_cpu
            if reference is None:
                reference = grads
            if i == 0:
                continue  # warm-up window
            times[name].append(elapsed)
            cpu[name].append(elapsed_cpu)
            peaks[name].append(memory.peak())
            errors[name].append(relative_error(grads, reference))
    base = statistics.median(times["(a) full batch, one pass"])
    base_cpu = statistics.median(cpu["(a) full batch, one pass"])
    print(
        f"global batch {ROWS} pairs, micro-batches of {MICRO}, {args.windows} windows, "
        f"{device.type}, {torch.get_num_threads()} threads"
    )
    print(
        f"{'arm':40s} {'s/window':>9s} {'vs (a)':>7s} {'CPU s':>7s} {'vs (a)':>7s} "
        f"{'peak MiB':>9s} {'grad error':>11s}"
    )
    for name in runs:
        t, c = statistics.median(times[name]), statistics.median(cpu[name])
        print(
            f"{name:40s} {t:9.3f} {t / base:6.2f}x {c:7.3f} {c / base_cpu:6.2f}x "
            f"{statistics.median(peaks[name]):9.1f} {max(errors[name]):11.2e}"
        )
    st = "(d) sentence-transformers cached MNRL"
    if st in runs:
        ours = "(b) fullbatch run_coupled"
        ratio = [b / d for b, d in zip(times[ours], times[st], strict=True)]
        print(
            f"(b) / (d), window by window: median {statistics.median(ratio):.3f}, "
            f"range {min(ratio):.3f}-{max(ratio):.3f}"
        )


if __name__ == "__main__":
    main()

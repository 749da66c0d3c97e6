"""bf16 parameters: gradient error against a float32 full-batch reference, by window size.

    python benchmarks/precision.py [--rows 64] [--length 64] [--batches 3]

A tiny causal LM with bf16 parameters trains on a fixed global batch of ``rows`` padded rows,
split into windows of 1, 8 and 32 micro-batches. For each split the gradient fullbatch hands
the optimizer (captured by an optimizer step pre-hook) is compared with the float32 full-batch
gradient of the same weights and data (``‖g - g_ref‖ / ‖g_ref‖`` over all parameters, the
median over ``batches`` batches), with bf16 accumulation (PyTorch's default: autograd adds
each backward into the bf16 ``.grad``) and with ``accumulate_dtype=torch.float32``. The
memory the option costs is computed from the buffered parameters: 4 bytes per element.
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch
from torch import nn

import fullbatch as fb

SPLITS = (1, 8, 32)


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


def make_batch(rows: int, length: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (rows, length), generator=gen)
    lengths = torch.randint(length // 4, length + 1, (rows,), generator=gen)
    labels = ids.masked_fill(torch.arange(length)[None, :] >= lengths[:, None], -100)
    return {"input_ids": ids, "labels": labels}


def reference(model: nn.Module, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The float32 full-batch gradient of the bf16 model's weights."""
    ref = copy.deepcopy(model).float()
    loss_sum, n = fb.causal_lm_loss(ref(batch["input_ids"]), batch["labels"])
    (loss_sum / n).backward()
    return [p.grad.detach().clone() for p in ref.parameters()]


def fullbatch_grads(
    model: nn.Module, batch: dict[str, torch.Tensor], micro_batches: int, dtype: torch.dtype | None
) -> list[torch.Tensor]:
    """The gradient the optimizer receives from one fullbatch window (bf16 parameters)."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    seen: list[torch.Tensor] = []
    opt.register_step_pre_hook(
        lambda o, a, k: seen.extend(p.grad.detach().float() for p in model.parameters())
    )
    rows = batch["input_ids"].shape[0] // micro_batches
    with fb.Accumulator(model, opt, micro_batch_size=rows, accumulate_dtype=dtype) as acc:
        for window in acc.windows([batch]):
            for micro in window:
                window.backward(*fb.causal_lm_loss(model(micro["input_ids"]), micro["labels"]))
            stats = window.step()
    assert stats.micro_batches == micro_batches and not stats.skipped
    return seen


def rel_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    pairs = zip(got, want, strict=True)
    diff = sum(float((g.double() - w.double()).square().sum()) for g, w in pairs)
    norm = sum(float(w.double().square().sum()) for w in want)
    return (diff / norm) ** 0.5


def measure(rows: int, length: int, batches: int, seed: int = 0) -> dict[str, dict[int, float]]:
    """Median relative error for each split, per accumulation dtype ("bf16", "fp32")."""
    torch.manual_seed(seed)
    model = TinyLM().to(torch.bfloat16)
    errors: dict[str, dict[int, list[float]]] = {"bf16": {}, "fp32": {}}
    for b in range(batches):
        batch = make_batch(rows, length, seed + b)
        want = reference(model, batch)
        for k in SPLITS:
            for name, dtype in (("bf16", None), ("fp32", torch.float32)):
                got = fullbatch_grads(model, batch, k, dtype)
                errors[name].setdefault(k, []).append(rel_error(got, want))
    return {n: {k: statistics.median(v) for k, v in e.items()} for n, e in errors.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64, help="rows per global batch")
    parser.add_argument("--length", type=int, default=64, help="tokens per row")
    parser.add_argument("--batches", type=int, default=3, help="batches (median taken)")
    args = parser.parse_args()
    assert args.rows % max(SPLITS) == 0, "rows must be a multiple of 32"
    torch.set_num_threads(1)
    errors = measure(args.rows, args.length, args.batches)
    model = TinyLM().to(torch.bfloat16)
    elements = sum(p.numel() for p in model.parameters())
    print(
        f"TinyLM, bf16 parameters ({elements:,} elements), global batch {args.rows} rows x "
        f"{args.length} tokens; relative gradient error vs the float32 full-batch gradient "
        f"(median of {args.batches} batches)"
    )
    print(f"{'micro-batches':>13} {'rows each':>9} {'bf16 accumulation':>18} {'fp32 buffers':>13}")
    for k in SPLITS:
        bf16, fp32 = errors["bf16"][k], errors["fp32"][k]
        print(f"{k:>13} {args.rows // k:>9} {bf16:>18.2e} {fp32:>13.2e}")
    print(
        f"memory of accumulate_dtype=torch.float32: {elements:,} bf16 elements x 4 bytes = "
        f"{elements * 4 / 2**20:.2f} MiB of float32 buffers (held during the window)"
    )


if __name__ == "__main__":
    main()

"""Train a tiny byte-level causal LM with fullbatch on every rank that torchrun starts.

    torchrun --standalone --nproc-per-node 2 examples/train_ddp.py           # CPU: gloo
    torchrun --standalone --nproc-per-node 8 examples/train_ddp.py --fsdp    # GPUs: nccl

The script is the same on CPUs and GPUs: the backend follows the device. Each rank reads its
own rows (rows of different lengths, so ranks hold different numbers of tokens), and every
optimizer step still equals one full-batch step over all ranks' rows.
"""

from __future__ import annotations

import argparse
import itertools
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

import fullbatch as fb


class TinyGPT(nn.Module):
    """Bytes in, next-byte logits out: embedding, causal transformer layers, a head."""

    def __init__(self, width: int = 64, layers: int = 2, context: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(257, width)  # 256 bytes + padding id 256
        self.pos = nn.Embedding(context, width)
        layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(width, 257)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=ids.device)
        h = self.embed(ids) + self.pos(torch.arange(t, device=ids.device))
        return self.head(self.blocks(h, mask=mask, is_causal=True))


def micro_batches(rank: int, world: int, rows: int, device: torch.device) -> Iterator[dict]:
    """This rank's share of the lines of this very file, as padded micro-batches, forever."""
    with open(__file__, encoding="utf-8") as f:
        lines = [line.encode()[:128] for line in f if line.strip()]
    mine = lines[rank::world]
    for start in itertools.count(0, rows):
        chunk = [mine[(start + i) % len(mine)] for i in range(rows)]
        width = max(len(b) for b in chunk)
        ids = torch.full((rows, width), 256)
        labels = torch.full((rows, width), -100)  # padding is not a prediction target
        for i, b in enumerate(chunk):
            ids[i, : len(b)] = labels[i, : len(b)] = torch.tensor(list(b))
        yield {"input_ids": ids.to(device), "labels": labels.to(device)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--micro-batches", type=int, default=4, help="per rank and window")
    parser.add_argument("--rows", type=int, default=8, help="rows per micro-batch")
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard), not DDP")
    args = parser.parse_args()

    # torchrun sets RANK, WORLD_SIZE and the rendezvous; the backend follows the device.
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(0)  # the same initial weights on every rank
    model: nn.Module = TinyGPT().to(device)
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks.layers:
            fully_shard(block)
        model = fully_shard(model)
    else:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device] if cuda else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 5))

    loader = micro_batches(rank, world, args.rows, device)
    with fb.Accumulator(
        model, optimizer, micro_batches=args.micro_batches, scheduler=scheduler, max_grad_norm=1.0
    ) as acc:
        for window in acc.windows(loader):
            for micro in window:  # DDP syncs only in this rank's last backward of the window
                logits = model(micro["input_ids"])
                loss_sum, n = fb.causal_lm_loss(logits, micro["labels"])
                window.backward(loss_sum, n)
            stats = window.step()  # identical on every rank
            if rank == 0:
                print(f"{stats} lr {stats.lr:.2e}", flush=True)
            if stats.steps >= args.steps:
                break
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

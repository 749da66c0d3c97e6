"""Rank functions for the DDP forward-route mistake (``tests/mistakes/test_ddp_module_forward``):
an Accumulator built on the DDP wrapper while the forward goes through ``ddp.module``.

A tiny causal LM in float64; the global batch is 8 right-padded rows, 4 per rank, cut into
micro-batches of 2 rows. DDP's gradient all-reduces are counted by a comm hook, fullbatch's
own collectives by patching ``torch.distributed`` (``_dist_count``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fullbatch as fb
from _dist_count import _Counter

LENGTHS = (7, 3, 5, 2, 6, 4, 8, 5)
VOCAB, LR = 17, 0.5


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.mix = nn.Linear(8, 8)
        self.out = nn.Linear(8, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        return self.out(h + torch.tanh(self.mix(h)))


def make_model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM().double()


def batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    width = max(LENGTHS)
    ids = torch.zeros(len(LENGTHS), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(LENGTHS):
        ids[row, :n] = torch.randint(1, VOCAB, (n,), generator=g)
        mask[row, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def full_batch_grad(model: nn.Module, rows: slice = slice(None)) -> torch.Tensor:
    """Plain PyTorch: mean next-token cross-entropy over the whole batch (or some rows)."""
    b = {k: v[rows] for k, v in batch().items()}
    model.zero_grad(set_to_none=True)
    logits = model(b["input_ids"])
    loss = F.cross_entropy(
        logits[:, :-1].flatten(0, 1), b["labels"][:, 1:].flatten(), reduction="sum"
    )
    loss.backward()
    out = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return out


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _counting_hook(calls: list[int]) -> Any:
    def hook(state, bucket):  # type: ignore[no-untyped-def]  (DDP checks annotations)
        calls.append(1)
        return (
            dist.all_reduce(bucket.buffer(), async_op=True)
            .get_future()
            .then(lambda fut: fut.value()[0] / dist.get_world_size())
        )

    return hook


def _window(
    model: DDP, acc: fb.Accumulator, rows: dict[str, torch.Tensor], via_module: bool
) -> Any:
    forward = model.module if via_module else model
    for window in acc.windows([rows]):
        for micro in window:
            logits = forward(micro["input_ids"])
            window.backward(*fb.causal_lm_loss(logits, micro["labels"]))
        return window.step()
    raise AssertionError("no window")


def route(rank: int, world: int) -> dict[str, Any]:
    """Three scenarios on the same ranks: the mistake, the correct form, ``ddp_sync="step"``."""
    mine = {k: v[rank * 4 : (rank + 1) * 4] for k, v in batch().items()}
    ddp = DDP(make_model())
    buckets: list[int] = []
    ddp.register_comm_hook(None, _counting_hook(buckets))
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    start = _flat(ddp)
    out: dict[str, Any] = {}
    with _Counter({}) as counter, fb.Accumulator(ddp, opt, micro_batch_size=2) as acc:
        try:
            _window(ddp, acc, mine, via_module=True)  # the mistake
            out["error"] = None
        except RuntimeError as error:
            out["error"] = str(error)
        out["unchanged"] = torch.equal(_flat(ddp), start)
        out["optimizer_state"] = len(opt.state)
        out["grads"] = sum(p.grad is not None for p in ddp.parameters())
        out["buckets_after_mistake"] = len(buckets)
        out["collectives_after_mistake"] = counter.take()
        stats = _window(ddp, acc, mine, via_module=False)  # the correct form, same Accumulator
        out["buckets"] = len(buckets)
        out["count"] = stats.count
        out["update"] = (start - _flat(ddp)) / LR
    step = DDP(make_model())
    start = _flat(step)
    opt = torch.optim.SGD(step.parameters(), lr=LR)
    with fb.Accumulator(step, opt, micro_batch_size=2, ddp_sync="step") as acc:
        _window(step, acc, mine, via_module=True)  # fullbatch reduces at the step: exact
    out["step_update"] = (start - _flat(step)) / LR
    return out

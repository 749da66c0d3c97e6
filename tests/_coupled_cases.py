"""A two-tower InfoNCE model, its data, and plain-PyTorch full-batch references.

Shared by ``tests/engine/test_coupled.py`` and the multi-process rank function below (run
on gloo ranks by ``_dist.run_ranks``). Everything is float64.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import fullbatch as fb

D_IN, HIDDEN, EMB = 5, 8, 4
TEMPERATURE = 0.1


class TwoTower(nn.Module):
    """Separate query and document encoders (with optional dropout) and a shared nothing."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.q = nn.Sequential(
            nn.Linear(D_IN, HIDDEN), nn.Tanh(), nn.Dropout(dropout), nn.Linear(HIDDEN, EMB)
        )
        self.d = nn.Sequential(
            nn.Linear(D_IN, HIDDEN), nn.Tanh(), nn.Dropout(dropout), nn.Linear(HIDDEN, EMB)
        )

    def forward(self, q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q(q), self.d(d)


def make_model(seed: int = 0, dropout: float = 0.0) -> TwoTower:
    torch.manual_seed(seed)
    return TwoTower(dropout).double()


def pairs(rows: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Query/document pairs: each document is a noisy copy of its query."""
    g = torch.Generator().manual_seed(1000 + seed)
    q = torch.randn(rows, D_IN, generator=g, dtype=torch.float64)
    d = q + 0.5 * torch.randn(rows, D_IN, generator=g, dtype=torch.float64)
    return {"q": q, "d": d}


def info_nce(reps: Any, rows: slice) -> tuple[torch.Tensor, int]:
    """In-batch negatives: query i's positive is document i, every other document a negative."""
    q, d = reps
    logits = q[rows] @ d.T / TEMPERATURE
    labels = torch.arange(d.shape[0], device=d.device)[rows]
    return fb.cross_entropy_sum(logits, labels)


def encoder(model: nn.Module) -> Any:
    return lambda micro: model(micro["q"], micro["d"])


def reference_grads(model: nn.Module, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Plain PyTorch: one forward of the whole batch, mean InfoNCE, one backward."""
    model.zero_grad(set_to_none=True)
    q, d = model(batch["q"], batch["d"])
    loss = F.cross_entropy(q @ d.T / TEMPERATURE, torch.arange(len(q)))
    loss.backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad(set_to_none=True)
    return grads


def rel(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    a = torch.cat([g.detach().reshape(-1) for g in got])
    b = torch.cat([w.detach().reshape(-1) for w in want])
    return float((a - b).norm() / b.norm())


# -- multi-process -----------------------------------------------------------------------------


def rank_rows(rank: int, layout: list[int], seed: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s rows of the global batch (ranks hold ``layout[rank]`` rows)."""
    batch = pairs(sum(layout), seed)
    start = sum(layout[:rank])
    return {k: v[start : start + layout[rank]] for k, v in batch.items()}


def ddp_coupled(
    rank: int,
    world: int,
    layout: list[int],
    micro_batch_size: int,
    windows: int,
    ddp_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train ``windows`` windows under DDP with run_coupled; final-gradient and comm counts."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    model = nn.parallel.DistributedDataParallel(
        make_model(), bucket_cap_mb=0.0005, **(ddp_options or {})
    )
    calls = {"grad": 0}

    def counting(state, bucket):  # type: ignore[no-untyped-def]  (DDP checks annotations)
        calls["grad"] += 1
        return default_hooks.allreduce_hook(state, bucket)

    model.register_comm_hook(None, counting)
    # DDP rebuilds its buckets after the first iteration: warm up twice, uncounted.
    for _ in range(2):
        q, d = model(pairs(2, 99)["q"], pairs(2, 99)["d"])
        (q.sum() + d.sum()).backward()
        model.zero_grad(set_to_none=True)
    # One plain synced backward measures the bucket count.
    q, d = model(pairs(2, 98)["q"], pairs(2, 98)["d"])
    calls["grad"] = 0
    (q.sum() + d.sum()).backward()
    buckets = calls["grad"]
    model.zero_grad(set_to_none=True)
    calls["grad"] = 0

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads: list[list[torch.Tensor]] = []
    losses: list[float] = []
    with fb.Accumulator(model, opt, micro_batch_size=micro_batch_size) as acc:
        acc.register_window_hook(
            lambda: grads.append([p.grad.detach().clone() for p in model.parameters()])
        )
        loader = [rank_rows(rank, layout, seed) for seed in range(windows)]
        for window in acc.windows(loader):
            losses.append(window.run_coupled(encoder(model), info_nce).loss)
    return {"grads": grads, "losses": losses, "syncs": calls["grad"], "buckets": buckets}


def fsdp_coupled(
    rank: int, world: int, layout: list[int], micro_batch_size: int, windows: int
) -> dict[str, Any]:
    """The same under FSDP2 (padding micro-batches where ranks hold fewer micro-batches)."""
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    fully_shard(model.q)
    fully_shard(model.d)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads: list[list[torch.Tensor]] = []
    losses: list[float] = []

    def full(g: Any) -> torch.Tensor:
        return (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()

    with fb.Accumulator(model, opt, micro_batch_size=micro_batch_size) as acc:
        acc.register_window_hook(lambda: grads.append([full(p.grad) for p in model.parameters()]))
        loader = [rank_rows(rank, layout, seed) for seed in range(windows)]
        for window in acc.windows(loader):
            losses.append(window.run_coupled(encoder(model), info_nce).loss)
    return {"grads": grads, "losses": losses}


def auto_coupled(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """``micro_batch_size="auto"`` under DDP or FSDP2: rank 1's encode runs out of memory
    above ``spec["fits"]`` rows in every forward (``spec["when"]`` "always") or in those that
    build a graph ("graph"), or in its first loss call ("loss")."""
    model: nn.Module = make_model()
    if spec["wrapper"] == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.q)
        fully_shard(model.d)
        fully_shard(model)
    fits = spec["fits"] if rank == 1 else 10**9
    calls: list[int] = []

    def encode(micro: dict[str, torch.Tensor]) -> Any:
        n = micro["q"].shape[0]
        calls.append(n)
        graph = torch.is_grad_enabled()
        if n > fits and (spec["when"] == "always" or (spec["when"] == "graph" and graph)):
            raise torch.OutOfMemoryError(f"{n} rows do not fit (threshold {fits})")
        return model(micro["q"], micro["d"])

    def loss(reps: Any, rows: slice) -> tuple[torch.Tensor, int]:
        calls.append(-1)
        if spec["when"] == "loss" and rank == 1 and calls.count(-1) == 1:
            raise torch.OutOfMemoryError("the loss does not fit (first call)")
        return info_nce(reps, rows)

    def full(g: Any) -> torch.Tensor:
        return (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads: list[list[torch.Tensor]] = []
    retries, sizes = [], []
    with fb.Accumulator(model, opt, micro_batch_size="auto") as acc:
        acc.register_window_hook(lambda: grads.append([full(p.grad) for p in model.parameters()]))
        loader = [rank_rows(rank, spec["layout"], seed) for seed in range(spec["windows"])]
        for window in acc.windows(loader):
            retries.append(window.run_coupled(encode, loss).retries)
            sizes.append(acc.micro_batch_size)
    return {"grads": grads, "retries": retries, "sizes": sizes, "calls": calls}

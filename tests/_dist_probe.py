"""Rank functions for the probe's DDP tests (importable by the forkserver), and the parent's
plain full-batch reference over every rank's micro-batches.

Each rank runs a hand-written DDP loop three times from the same parameters: without the probe,
then under ``fb.probe`` with a callable objective (each micro-batch replayed at ``step()``) and
with the built-in ``"sample"`` (each micro-batch differentiated on its own forward's graph),
with a comm hook counting DDP's gradient all-reduces. It returns the probe's report, the
gradient each run was about to apply at each step, the final parameters of every run and the
all-reduce counts.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

import fullbatch as fb
from _probe_cases import IGNORE, counted, make_net, micro_batches, objective
from fullbatch._probe import _reference

#: Micro-batch sizes per rank and window: uneven rows, and rank 0 runs one more micro-batch.
LAYOUT = {0: [(1, 4, 2), (3, 2, 2)], 1: [(3, 2), (2, 5)]}


def data(rank: int) -> list[list[dict[str, torch.Tensor]]]:
    return [micro_batches(sizes, seed=10 * rank + w) for w, sizes in enumerate(LAYOUT[rank])]


def _loop(
    rank: int, world: int, how: str, dropout: float, probed: bool, declared: Any = objective
) -> dict[str, Any]:
    model = DistributedDataParallel(make_net(dropout=dropout))
    calls = {"allreduce": 0}

    def counting(state, bucket):  # type: ignore[no-untyped-def]  (DDP checks annotations)
        calls["allreduce"] += 1
        return default_hooks.allreduce_hook(state, bucket)

    model.register_comm_hook(None, counting)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    applied: list[list[torch.Tensor]] = []
    torch.manual_seed(100 + rank)  # dropout masks differ per rank, as in real training
    probe = fb.probe(objective=declared, windows=2) if probed else None
    if probe is not None:
        probe.__enter__()
    try:
        for window in data(rank):
            own = float(sum(counted(m) for m in window))
            total = torch.tensor(own)
            dist.all_reduce(total)  # the window's count over every rank
            for i, micro in enumerate(window):
                last = i == len(window) - 1
                sync = last and how != "never sync"
                with model.no_sync() if not sync else _nothing():
                    logits = model(micro)
                    loss_sum, _ = fb.cross_entropy_sum(logits, micro["labels"])
                    if how == "mean/K":
                        mean = F.cross_entropy(logits, micro["labels"], ignore_index=IGNORE)
                        (mean / len(window)).backward()
                    elif how == "per-rank count":  # this rank's own count, not the window's
                        (loss_sum / own).backward()
                    else:  # DDP averages over ranks: scale by the world size
                        (loss_sum * world / total).backward()
            applied.append([p.grad.detach().clone() for p in model.parameters()])
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        if probe is not None:
            probe.__exit__(None, None, None)
    return {
        "report": None if probe is None else probe.report,
        "applied": applied,
        "params": [p.detach().clone() for p in model.parameters()],
        "allreduce": calls["allreduce"],
    }


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def probe_rank(rank: int, world: int, how: str, dropout: float) -> dict[str, Any]:
    plain = _loop(rank, world, how, dropout, probed=False)
    probed = _loop(rank, world, how, dropout, probed=True)
    replays = {"n": 0}
    original = _reference.replay

    def counted_replay(*args: Any, **kwargs: Any) -> Any:
        replays["n"] += 1
        return original(*args, **kwargs)

    _reference.replay = counted_replay  # type: ignore[assignment]
    try:
        builtin = _loop(rank, world, how, dropout, probed=True, declared="sample")
    finally:
        _reference.replay = original  # type: ignore[assignment]
    return {"plain": plain, "probed": probed, "builtin": builtin, "replays": replays["n"]}


def reference() -> list[torch.Tensor]:
    """The first window's full batch (every rank's micro-batches) from the initial parameters
    (no dropout): a mean loss over counted rows, one backward."""
    model = make_net(dropout=0.0)
    window = [m for rank in sorted(LAYOUT) for m in data(rank)[0]]
    batch = {k: torch.cat([m[k] for m in window]) for k in window[0]}
    F.cross_entropy(model(batch), batch["labels"], ignore_index=IGNORE).backward()
    return [p.grad.detach().clone() for p in model.parameters()]

"""Rank functions for the probe on ColossalAI-shaped objects (``TorchDDPPlugin``'s
``TorchDDPModel`` around DDP, ``OptimizerWrapper`` around the torch optimizer: the stand-ins of
``tests/_colossal_cases.py``), 2 gloo ranks, and the parent's plain full-batch reference.

ColossalAI pins an old torch, so CI cannot install it; ``benchmarks/seed_frameworks.py
--probe`` runs the real one. The mechanism is reproduced here: the outermost module that runs
is a wrapper whose only child is DDP (the probe looks through it to the model inside, and keeps
the DDP wrapper's process group), the optimizer that steps is the torch optimizer inside
``OptimizerWrapper.step``, and ``optimizer.backward(loss, retain_graph=True)`` makes two backward
passes per micro-batch (ColossalAI #5601): on the window's last micro-batch DDP reduces the first
one only, and the second stays on its rank, so the replicas diverge.

Each rank trains one window twice from the same parameters, without the probe and under it, with
a comm hook counting DDP's bucket all-reduces.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import fullbatch as fb
from _colossal_cases import OptimizerWrapper, TorchDDPModel
from _probe_cases import IGNORE, counted, make_net, micro_batches

#: Micro-batch sizes per rank: uneven rows, and rank 0 runs one more micro-batch.
LAYOUT = {0: (1, 4, 2), 1: (3, 2)}
Z = 0.01  # the second term's weight: a z-loss-like square of the logits


def data(rank: int) -> list[dict[str, torch.Tensor]]:
    return micro_batches(LAYOUT[rank], seed=20 + rank)


def two_terms(model: torch.nn.Module, micro: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The objective: Σ cross-entropy + Z · Σ logits² over the counted rows, and their count."""
    logits = model(micro)
    ce, n = fb.cross_entropy_sum(logits, micro["labels"])
    keep = micro["labels"] != IGNORE
    return ce + Z * logits[keep].square().sum(), n


def _window(model: Any, optimizer: OptimizerWrapper, rank: int, world: int, how: str) -> None:
    """One window as a ColossalAI user writes it: ``no_sync`` but the last micro-batch."""
    window = data(rank)
    total = torch.tensor(float(sum(counted(m) for m in window)))
    dist.all_reduce(total)  # the window's count over every rank: the normalization is right
    scale = world / float(total)  # DDP averages over the ranks: x world undoes it
    for i, micro in enumerate(window):
        last = i == len(window) - 1
        with contextlib.nullcontext() if last else model.module.no_sync():
            logits = model(micro)
            ce, _ = fb.cross_entropy_sum(logits, micro["labels"])
            keep = micro["labels"] != IGNORE
            z = Z * logits[keep].square().sum()
            if how == "two backward":
                optimizer.backward(ce * scale, retain_graph=True)
                optimizer.backward(z * scale)
            else:  # "right": one backward of both terms
                optimizer.backward((ce + z) * scale)


def _run(
    rank: int, world: int, how: str, probe_model: str | None, find_unused: bool
) -> dict[str, Any]:
    model = TorchDDPModel(make_net(), find_unused_parameters=find_unused)
    buckets = {"n": 0}

    def counting(state, bucket):  # type: ignore[no-untyped-def]  (DDP checks annotations)
        buckets["n"] += 1
        return default_hooks.allreduce_hook(state, bucket)

    model.module.register_comm_hook(None, counting)
    optimizer = OptimizerWrapper(torch.optim.SGD(model.parameters(), lr=0.1))
    probe = None
    if probe_model is not None:  # "global": fb.probe() finds the model; "given": model=
        probe = fb.probe(model if probe_model == "given" else None, objective=two_terms)
    applied = []
    with probe if probe is not None else contextlib.nullcontext():
        for _ in range(2):  # the probed window, and one after it (its hooks gone)
            _window(model, optimizer, rank, world, how)
            applied.append([p.grad.detach().clone() for p in model.parameters()])
            optimizer.step()
            optimizer.zero_grad()
    return {
        "report": None if probe is None else probe.report,
        "applied": applied,
        "params": [p.detach().clone() for p in model.parameters()],
        "buckets": buckets["n"],
    }


def colossal_rank(
    rank: int, world: int, how: str, probe_model: str, find_unused: bool = False
) -> dict[str, Any]:
    return {
        "plain": _run(rank, world, how, None, find_unused),
        "probed": _run(rank, world, how, probe_model, find_unused),
    }


def reference() -> list[torch.Tensor]:
    """The window's full batch over every rank's micro-batches, from the initial parameters:
    the two terms' mean over the counted rows, one backward."""
    model = make_net()
    window = [m for rank in sorted(LAYOUT) for m in data(rank)]
    batch = {k: torch.cat([m[k] for m in window]) for k in window[0]}
    loss, n = two_terms(model, batch)
    (loss / n).backward()
    return [p.grad.detach().clone() for p in model.parameters()]

"""Rank functions for the probe on a tiny MoE model under FSDP2 (test_probe_moe_fsdp.py).

One window of a float64 Mixtral with its router aux loss on, ``fully_shard`` per decoder layer
and at the root over 2 gloo ranks, probed with the objective inferred (``causal_lm+moe``):

- ``"exact"``: ``fb.Accumulator`` with ``window.stats`` (the routing counts over every
  micro-batch and rank) and ``fb.moe.load_balancing`` added to each micro-batch's loss;
- ``"padded"``: the same loop on uneven micro-batch counts (2 and 3), so rank 0 also runs a
  zero-weight padding micro-batch (FSDP2's all-gathers need as many forwards on every rank),
  which the probe refuses on every rank (it cannot yet tell it from a micro-batch) while the
  run goes on;
- ``"stock"``: a plain loop as TRL's SFTTrainer writes it: the cross-entropy exact (its sum over
  the window's tokens of every rank, times the world size FSDP2 averages over) plus each
  micro-batch's own ``coef · out.aux_loss / K``: the load balancing taken per micro-batch.

Each returns the probe's verdict and the full parameters' change (SGD, lr 1: the applied
gradient), which the parent compares with a float64 full batch of every rank's rows.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import fullbatch as fb
from _dist_moe import MOE_SPLIT, moe_window
from _moe_cases import COEF, exact_share, make_moe, routing, split, tokens

#: Rows of each rank's micro-batches: as many micro-batches on every rank (FSDP2's all-gathers
#: need as many forwards), uneven rows and tokens.
SPLIT = {0: [1, 3], 1: [3, 1]}


def _sharded() -> tuple[Any, Any]:
    from torch.distributed.fsdp import fully_shard

    model = make_moe("mixtral")
    model.config.output_router_logits = True  # the model adds coef · aux: objective inferred
    for layer in model.model.layers:
        fully_shard(layer)
    return model, fully_shard(model)


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()


def _rows(rank: int, layout: dict[int, list[int]]) -> list[dict[str, torch.Tensor]]:
    start = sum(sum(layout[r]) for r in range(rank))
    stop = start + sum(layout[rank])
    return split({k: v[start:stop] for k, v in moe_window().items()}, layout[rank])


def _exact(model: Any, opt: Any, rank: int, layout: dict[int, list[int]]) -> None:
    micros = _rows(rank, layout)
    acc = fb.Accumulator(model, opt, micro_batches=len(micros), counts=tokens())
    for window in acc.windows(micros):
        counts = window.stats(routing(model))
        for micro in window:
            window.backward(exact_share(model, window, counts, micro))
        window.step()


def _stock(model: Any, opt: Any, rank: int, world: int) -> None:
    micros = _rows(rank, SPLIT)
    total = torch.tensor(float(sum(fb.count_tokens(m["labels"]) for m in micros)))
    dist.all_reduce(total)
    for micro in micros:
        out = model(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"])
        ce, _ = fb.causal_lm_loss(out.logits, micro["labels"])
        (ce * world / total + COEF * out.aux_loss / len(micros)).backward()
    opt.step()


def moe_fsdp(rank: int, world: int) -> dict[str, Any]:
    """Both loops under ``fb.probe(windows=1)``: each one's verdict and applied gradient."""
    out: dict[str, Any] = {}
    for how in ("exact", "stock", "padded"):
        inner, model = _sharded()
        before = [_full(p) for p in inner.parameters()]
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        with fb.probe(windows=1) as probe:
            if how == "stock":
                _stock(model, opt, rank, world)
            else:
                _exact(model, opt, rank, SPLIT if how == "exact" else MOE_SPLIT)
        update = [b - _full(p) for b, p in zip(before, inner.parameters(), strict=True)]
        if how == "padded":
            report = probe.report
            out[how] = {"ok": report.ok, "windows": len(report.windows), "update": update,
                        "problems": report.problems}  # fmt: skip
            continue
        (w,) = probe.report.windows
        out[how] = {"ok": w.ok, "patterns": w.patterns, "share": w.statistic_share,
                    "error": w.error, "objective": w.objective, "ranks": w.ranks,
                    "micro_batches": w.micro_batches, "diagnosis": w.diagnosis,
                    "update": update, "text": str(probe.report)}  # fmt: skip
    return out

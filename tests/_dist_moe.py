"""Rank functions for window statistics under DDP and FSDP2 (see test_distributed_window_stats)."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import fullbatch as fb
from _moe_cases import COEF, exact_share, make_moe, moe_rows, routing, split, tokens
from _selection_cases import cut, importance, loss_sum, threshold, with_old

# Each rank's rows and its uneven micro-batches: rank 0 holds 2 micro-batches, rank 1 holds 3.
MOE_LENGTHS = [7, 3, 5, 6, 2, 7, 4, 5]
MOE_SPLIT = {0: [1, 3], 1: [2, 1, 1]}


def moe_window() -> dict[str, torch.Tensor]:
    return moe_rows(MOE_LENGTHS, seed=11)


def _rank_rows(rank: int) -> tuple[int, int]:
    start = sum(sum(MOE_SPLIT[r]) for r in range(rank))
    return start, start + sum(MOE_SPLIT[rank])


def moe_rank(rank: int, world: int, families: tuple[str, ...]) -> dict[str, Any]:
    """Every family in one run of the ranks (a start of the ranks costs more than a step), under
    DDP, and the first under FSDP2 too (keyed ``"<family>/fsdp2"``)."""
    out = {family: _moe_family(rank, family) for family in families}
    out[f"{families[0]}/fsdp2"] = _moe_family(rank, families[0], fsdp=True)
    return out


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()


def _moe_family(rank: int, family: str, fsdp: bool = False) -> dict[str, Any]:
    model = make_moe(family)
    before = [p.detach().clone() for p in model.parameters()]
    if fsdp:  # every forward all-gathers: rank 0's pre-pass runs a padding micro-batch too
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        ddp: Any = fully_shard(model)
    else:
        ddp = DDP(model, find_unused_parameters=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=1.0)
    start, stop = _rank_rows(rank)
    rows = {k: v[start:stop] for k, v in moe_window().items()}
    micros = split(rows, MOE_SPLIT[rank])
    acc = fb.Accumulator(ddp, opt, micro_batches=len(micros), counts=tokens())
    stat, calls = routing(ddp), []

    def counted(micro: dict) -> Any:
        calls.append(int(micro["input_ids"].shape[0]))
        return stat(micro)

    for window in acc.windows(micros):
        counts = window.stats(counted)
        for micro in window:
            window.backward(exact_share(ddp, window, counts, micro))
        stats = window.step()
    update = [b - _full(p) for b, p in zip(before, model.parameters(), strict=True)]
    return {"update": update, "loss": stats.loss, "calls": calls, "counts": counts}


SEL_SPLIT = {0: [1, 4], 1: [2, 2, 1]}
SEL_LENGTHS = [9, 2, 5, 1, 7, 3, 6, 4, 8, 2]


def selection_window() -> dict[str, Any]:
    from conftest import lm_batch

    return with_old(lm_batch(SEL_LENGTHS, seed=3, ignore_frac=0.2), seed=5)


def selection_rank(rank: int, world: int) -> dict[str, Any]:
    from conftest import make_lm

    model = make_lm()
    before = [p.detach().clone() for p in model.parameters()]
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1.0)
    start = sum(sum(SEL_SPLIT[r]) for r in range(rank))
    batch = selection_window()
    mine = cut(batch, [start, sum(SEL_SPLIT[rank])])[1]
    micros = cut(mine, SEL_SPLIT[rank])
    acc = fb.Accumulator(ddp, opt, micro_batches=len(micros))
    for window in acc.windows(micros):
        values = window.stats(lambda m: importance(ddp, m), reduce="cat")
        limit = threshold(values)
        for micro in window:
            window.backward(*loss_sum(ddp, micro, limit))
        stats = window.step()
    update = [b - p.detach() for b, p in zip(before, model.parameters(), strict=True)]
    return {"update": update, "count": stats.count, "limit": float(limit), "n": values.numel()}


def probed_moe_rank(rank: int, world: int) -> dict[str, Any]:
    """Under ``fb.probe`` (objective inferred: causal_lm+moe), one window on each rank: the
    exact route (``window.stats``), then the Trainer's recipe by hand (the cross-entropy over
    the window's tokens of every rank, each micro-batch's own aux loss); each run's verdict
    and update."""
    import torch.distributed as dist

    out: dict[str, Any] = {}
    for how in ("exact", "stock"):
        model = make_moe("mixtral")
        model.config.output_router_logits = True  # the model adds its aux loss: inferred
        before = [p.detach().clone() for p in model.parameters()]
        ddp = DDP(model, find_unused_parameters=True)
        opt = torch.optim.SGD(ddp.parameters(), lr=1.0)
        start, stop = _rank_rows(rank)
        micros = split({k: v[start:stop] for k, v in moe_window().items()}, MOE_SPLIT[rank])
        with fb.probe(windows=1) as probe:
            if how == "exact":
                acc = fb.Accumulator(ddp, opt, micro_batches=len(micros), counts=tokens())
                for window in acc.windows(micros):
                    counts = window.stats(routing(ddp))
                    for micro in window:
                        window.backward(exact_share(ddp, window, counts, micro))
                    window.step()
            else:
                total = torch.tensor(float(sum(fb.count_tokens(m["labels"]) for m in micros)))
                dist.all_reduce(total)
                for i, micro in enumerate(micros):
                    last = i == len(micros) - 1
                    with ddp.no_sync() if not last else _nothing():
                        o = ddp(input_ids=micro["input_ids"],
                                attention_mask=micro["attention_mask"])  # fmt: skip
                        ce, _ = fb.causal_lm_loss(o.logits, micro["labels"])
                        (ce * world / total + COEF * o.aux_loss).backward()
                opt.step()
        (w,) = probe.report.windows
        update = [b - p.detach() for b, p in zip(before, model.parameters(), strict=True)]
        out[how] = {"ok": w.ok, "patterns": w.patterns, "share": w.statistic_share,
                    "error": w.error, "objective": w.objective, "update": update}  # fmt: skip
    return out


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None

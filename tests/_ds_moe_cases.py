"""Rank functions for ``window.stats`` on a raw DeepSpeed engine with a MoE model
(tests/integrations/test_deepspeed_window_stats.py).

A tiny float32 Mixtral (tests/_moe_cases.py) with its load-balancing loss, SGD with lr=1 (the
parameter change is the applied gradient). Two gloo ranks, two windows of 3 micro-batches of
uneven rows (:data:`SIZES`); in the last, rank 1 holds one and runs two padding ones. Every rank
returns, per window, its parameters before and after the step (full, float64), how many rows
each pre-pass call saw, and the window's ``StepStats``.
"""

from __future__ import annotations

from typing import Any

import torch

import _moe_cases as moe
from _ds_cases import full_params

K = 3  # micro-batches per rank in a window (DeepSpeed's gradient_accumulation_steps)
# rows per micro-batch, per window and rank: the last window is short on rank 1 (it pads)
SIZES = (((1, 3, 2), (2, 1, 2)), ((2, 1, 3), (3,)))
LENGTHS = (7, 3, 5, 7, 2, 6, 4, 1, 6, 3, 5)  # real tokens per row of a window, rank 0 first


def window_rows(window: int) -> dict[str, torch.Tensor]:
    """Every rank's rows of ``window`` in rank order: the full batch the step must equal."""
    rows = sum(sum(sizes) for sizes in SIZES[window])
    return moe.moe_rows(LENGTHS[:rows], seed=10 + window)


def loader(rank: int) -> list[dict[str, torch.Tensor]]:
    """Rank ``rank``'s micro-batches of every window, in order."""
    out = []
    for w, sizes in enumerate(SIZES):
        first = sum(sizes[0]) if rank == 1 else 0
        mine = {k: v[first : first + sum(sizes[rank])] for k, v in window_rows(w).items()}
        out += moe.split(mine, sizes[rank])
    return out


def _engine(world: int, stage: int) -> Any:
    import deepspeed

    from _dist_ds import config

    model = moe.make_moe("mixtral").float()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    cfg = config(stage, micro_batches=K, world=world)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return engine


def _forward(engine: Any, micro: dict[str, torch.Tensor]) -> Any:
    return engine(
        input_ids=micro["input_ids"],
        attention_mask=micro["attention_mask"],
        output_router_logits=True,
    )


def train(rank: int, world: int, stage: int, exact: bool) -> dict[str, Any]:
    """Two windows. ``exact``: the routing counts from ``window.stats`` (the full batch's
    objective); else each micro-batch's own counts, its stock aux loss averaged over the
    window's micro-batches of every rank (the "per-micro-batch aux" recipe), window 0 only."""
    import fullbatch as fb
    from fullbatch.deepspeed import ExactEngine

    engine = _engine(world, stage)
    counted = ExactEngine(engine, count=lambda m: fb.count_tokens(m["labels"]))
    seen: list[int] = []

    def routing(micro: dict[str, torch.Tensor]) -> Any:
        seen.append(len(micro["input_ids"]))
        out = _forward(engine, micro)
        return fb.moe.router_counts(
            out.router_logits, top_k=moe.TOP_K, attention_mask=micro["attention_mask"]
        )

    out: dict[str, Any] = {"before": [], "after": [], "calls": [], "stats": [], "late": []}
    for w, window in enumerate(counted.windows(loader(rank))):
        if not exact and w > 0:
            break
        out["before"].append(full_params(engine))
        seen.clear()
        counts = window.stats(routing) if exact else None
        again = window.stats(routing) if exact else None  # kept: no second pre-pass
        out["calls"].append(list(seen))
        if exact:  # a "cat" statistic: every real row's length, ranks in order
            lengths = window.stats(lambda m: m["attention_mask"].sum(1), reduce="cat", key="n")
            out.setdefault("lengths", []).append(lengths)
        out["same"] = counts is again
        for i, micro in enumerate(window):
            res = _forward(engine, micro)
            ce, n = fb.causal_lm_loss(res.logits, micro["labels"])
            mask = micro["attention_mask"]
            if exact:
                aux = fb.moe.load_balancing(res.router_logits, counts, attention_mask=mask)
            else:
                own = fb.moe.router_counts(res.router_logits, top_k=moe.TOP_K, attention_mask=mask)
                aux = fb.moe.load_balancing(res.router_logits, own, attention_mask=mask)
                aux = aux / sum(len(sizes) for sizes in SIZES[w])
            window.backward(ce + window.count * moe.COEF * aux, n)
            if exact and w == 0 and i == 0:
                try:
                    window.stats(lambda m: m["attention_mask"].sum(), key="late")
                except RuntimeError as exc:
                    out["late"].append(str(exc))
        out["stats"].append(window.step())
        out["after"].append(full_params(engine))
    return out


def train_all(rank: int, world: int, runs: list[tuple[int, bool]]) -> dict[Any, Any]:
    """Every ``(stage, exact)`` of ``runs``, one engine each, in one launch."""
    return {run: train(rank, world, *run) for run in runs}

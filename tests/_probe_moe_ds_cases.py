"""Rank functions for the probe on a MoE model under the Hugging Face Trainer over DeepSpeed
(tests/probe/test_probe_moe_deepspeed.py), one process group.

A float32 Mixtral with its router aux loss on (DeepSpeed refuses float64 reductions), ZeRO-3
with every parameter partitioned (the probe's replays and its routing pre-pass gather them on
every rank), 2 rows per micro-batch, the 8 rows of ``LENGTHS`` one window over the ranks. One
window of the stock ``Trainer`` (its aux loss per micro-batch, added undivided) and one of
``fullbatch.hf.ExactTrainer(loss="causal_lm")``, each under ``fb.probe(windows=1)`` with the
objective inferred; each returns the verdict and the full parameters' change (SGD, lr 1: the
applied gradient), which the parent compares with a float64 full batch of every rank's rows.
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch

import _hf_cases as h
from _dist_ds import trainer_config
from _ds_trainer_cases import full_params
from _moe_cases import _collate, make_moe, moe_rows

#: Real tokens per row: uneven micro-batches of 2 rows (2 per rank).
LENGTHS = (7, 3, 5, 7, 2, 6, 4, 1)


def window() -> dict[str, torch.Tensor]:
    return moe_rows(LENGTHS, seed=1)


def _step(world: int, exact: bool) -> dict[str, Any]:
    from transformers import Trainer, TrainerCallback

    import fullbatch as fb
    from fullbatch.hf import ExactTrainer

    model = make_moe("mixtral").float()
    model.config.output_router_logits = True  # the model adds coef · aux: objective inferred
    before = [p.detach().double().clone() for p in model.parameters()]
    rows = window()
    data = [{k: v[i] for k, v in rows.items()} for i in range(len(LENGTHS))]
    after: list[dict[str, torch.Tensor]] = []

    class Record(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            after.append(full_params(kw["model"]))

    with tempfile.TemporaryDirectory() as tmp:
        args = h.training_args(
            tmp, k=len(LENGTHS) // (2 * world), batch=2, learning_rate=1.0, max_steps=1,
            deepspeed=trainer_config(3),
        )  # fmt: skip
        kwargs: dict[str, Any] = dict(
            model=model, args=args, train_dataset=data, data_collator=_collate,
            callbacks=[Record()],
        )  # fmt: skip
        trainer = ExactTrainer(**kwargs, loss="causal_lm") if exact else Trainer(**kwargs)
        with fb.probe(windows=1) as probe:
            h.in_order(trainer).train()
    (params,) = after
    (w,) = probe.report.windows
    return {
        "ok": w.ok, "patterns": w.patterns, "share": w.statistic_share, "error": w.error,
        "tolerance": w.tolerance, "objective": w.objective, "engine": w.engine,
        "ranks": w.ranks, "diagnosis": w.diagnosis, "text": str(probe.report),
        "update": [b - p for b, p in zip(before, params.values(), strict=True)],
    }  # fmt: skip


def moe_trainers(rank: int, world: int) -> dict[str, Any]:
    """The stock Trainer's window and ExactTrainer's, in one process group."""
    return {"stock": _step(world, exact=False), "exact": _step(world, exact=True)}


def padded_engine(rank: int, world: int) -> Any:
    """``fullbatch.deepspeed.ExactEngine`` at ZeRO-2 with 3 micro-batches on rank 0 and 4 on
    rank 1 (rank 0 runs one zero-weight padding micro-batch), probed: the report, and the
    applied gradient (SGD lr 1, momentum 0: the parameters' move)."""
    import deepspeed

    import _probe_ds_cases as raw
    import fullbatch as fb
    from _dist_ds import config
    from fullbatch.deepspeed import ExactEngine

    model = raw.make_model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    cfg = config(2, micro_batches=4, world=world)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    micros = raw.micro_batches(rank)[: 3 if rank == 0 else 4]
    exact = ExactEngine(engine, count=lambda m: (m["y"] != -100).sum())
    with fb.probe(objective=raw.objective, windows=1) as probe:
        for window in exact.windows(micros):
            for micro in window:
                window.backward(*raw.objective(engine, micro))
            window.step()
    after = raw.full_params(engine)
    return {"report": probe.report, "update": [b - a for b, a in zip(before, after, strict=True)]}


def everything(rank: int, world: int) -> dict[str, Any]:
    """Both Trainer windows and the padded ExactEngine window, in one process group."""
    return {**moe_trainers(rank, world), "padded": padded_engine(rank, world)}

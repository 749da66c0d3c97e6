"""Rank functions for the probe on the Hugging Face Trainer and Accelerate over DeepSpeed
(tests/probe/test_probe_deepspeed_hf.py), all in one process group.

- The stock ``Trainer`` with a DeepSpeed config (``gradient_accumulation_steps=4`` of 2 rows):
  a causal LM that honours ``num_items_in_batch`` (right), a BERT masked-LM head that drops it
  (a per-micro-batch mean: wrong), and the causal LM with ``gradient_clipping`` left out of the
  config (DeepSpeed then clips at 1.0 although ``max_grad_norm`` is 0.3); ``ExactTrainer`` on the
  same config. Each is probed for its first two windows; the causal LM also runs unprobed, and
  both runs' full parameters after every step come back.
- Accelerate's DeepSpeed plugin: a loop with ``accelerator.backward`` on a per-micro-batch
  mean (DeepSpeed divides by the accumulation steps: the mean of per-micro-batch means) and
  ``ExactEngine`` on the engine Accelerate prepared.
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch

import _hf_cases as h
import _probe_ds_cases as raw
from _dist_ds import config, trainer_config

K, BATCH = 4, 2


def _steps_recorder(steps: list[Any]) -> Any:
    from transformers import TrainerCallback

    from _ds_trainer_cases import full_params

    class Record(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            steps.append(full_params(kw["model"]))

    return Record()


def trainer_run(run: tuple[Any, ...], rows: list[Any], probed: bool) -> dict[str, Any]:
    """``run = (stage, offload, model kind, ExactTrainer loss or None, gradient_clipping[,
    max_grad_norm])`` (``max_grad_norm`` 0 unless given)."""
    from transformers import Trainer

    import fullbatch as fb

    stage, offload, kind, exact, clip = run[:5]
    max_grad_norm = run[5] if len(run) > 5 else 0.0
    steps: list[Any] = []
    objective = "causal_lm" if kind == "causal_lm" else "token"
    model = (h.llama() if kind == "causal_lm" else h.bert("masked_lm")).float()
    with tempfile.TemporaryDirectory() as tmp:
        args = h.training_args(
            tmp,
            k=K,
            batch=BATCH,
            deepspeed=trainer_config(stage, offload=offload, clip=clip),
            max_grad_norm=max_grad_norm,
        )
        kwargs: dict[str, Any] = dict(
            model=model,
            args=args,
            train_dataset=rows,
            data_collator=h.Collator(kind),
            callbacks=[_steps_recorder(steps)],
        )
        if exact is None:
            trainer: Any = Trainer(**kwargs)
        else:
            from fullbatch.hf import ExactTrainer

            trainer = ExactTrainer(**kwargs, loss=exact)
        if not probed:
            h.in_order(trainer).train()
            return {"steps": steps}
        with fb.probe(objective=objective, windows=2) as probe:
            h.in_order(trainer).train()
    return {"steps": steps, "report": probe.report}


def _accelerated(world: int, stage: int, offload: bool) -> Any:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin

    AcceleratorState._reset_state(True)  # one Accelerator per engine in this process
    model = raw.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    cfg = config(stage, offload=offload, micro_batches=K, world=world)
    accelerator = Accelerator(
        deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg), gradient_accumulation_steps=K
    )
    engine, opt = accelerator.prepare(model, opt)
    return accelerator, engine, opt


def accelerate_run(rank: int, world: int, stage: int, offload: bool, how: str) -> Any:
    """Two windows on Accelerate's DeepSpeed engine, probed: ``how`` ``"mean"`` (the stock
    Accelerate loop) or ``"exact"`` (``ExactEngine``)."""
    import fullbatch as fb
    from fullbatch.deepspeed import ExactEngine

    accelerator, engine, opt = _accelerated(world, stage, offload)
    micros = raw.micro_batches(rank)
    with fb.probe(objective=raw.objective, windows=2) as probe:
        if how == "exact":
            exact = ExactEngine(engine, count=lambda m: (m["y"] != -100).sum())
            for window in exact.windows(micros * 2):
                for micro in window:
                    window.backward(*raw.objective(engine, micro))
                window.step()
        else:
            for micro in micros * 2:
                with accelerator.accumulate(engine):
                    loss = torch.nn.functional.cross_entropy(engine(micro["x"]), micro["y"])
                    accelerator.backward(loss)
                    opt.step()
                    opt.zero_grad()
    return probe.report


TRAINER_RUNS = [
    (2, True, "causal_lm", None, "auto"),
    (3, False, "masked_lm", None, "auto"),
    (2, False, "causal_lm", None, None, 0.3),
    (3, True, "causal_lm", "causal_lm", "auto"),
]


def everything(rank: int, world: int, n_rows: int) -> dict[Any, Any]:
    """Every Trainer run of ``TRAINER_RUNS`` (probed; the first also unprobed) and the two
    Accelerate loops at ZeRO-2 with offload."""
    rows = h.text_rows(n_rows)
    out: dict[Any, Any] = {run: trainer_run(run, rows, True) for run in TRAINER_RUNS}
    out["plain"] = trainer_run(TRAINER_RUNS[0], rows, False)
    for how in ("mean", "exact"):
        out[("accelerate", how)] = accelerate_run(rank, world, 2, True, how)
    return out

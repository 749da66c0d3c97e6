"""Rank functions for ``ExactGRPOTrainer`` under DeepSpeed (test_trl_grpo_deepspeed.py).

The GRPO runs of tests/_grpo_cases.py with a DeepSpeed config (tests/_dist_ds.py
``trainer_config``) and a float32 policy (DeepSpeed refuses float64 reductions). The engine
steps inside the window's last backward and ZeRO partitions the gradients, so the recorder
reads whole parameters (``safe_get_full_fp32_param``) before and after each step and recovers
the applied gradient from the SGD update: ``(before - after) / lr``.
"""

from __future__ import annotations

from typing import Any

import torch

import _grpo_cases as cases
from _dist_ds import trainer_config


def _full(trainer: Any) -> dict[str, torch.Tensor]:
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    for name, p in trainer.model.named_parameters():
        full = safe_get_full_fp32_param(p)
        out[name] = (p if full is None else full).detach().double().clone()
    return out


class Recorder(cases._Recorder):
    """Parameters before each step and the gradient its SGD update applied."""

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        lr = float(kwargs["optimizer"].param_groups[0]["lr"])  # what this step uses
        self.steps.append({"params": _full(self.trainer), "micro": [], "lr": lr})

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        pass  # DeepSpeed stepped inside the last backward

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        before, after = self.steps[-1]["params"], _full(self.trainer)
        lr = args.learning_rate
        self.steps[-1]["grads"] = {k: (before[k] - after[k]) / lr for k in before}


def train(rank: int, world: int, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each run (``stage``, ``offload``, ``stock`` and GRPOConfig options) with
    ExactGRPOTrainer and, where ``stock``, GRPOTrainer; the recorded steps of each."""
    from trl import GRPOTrainer

    from fullbatch.trl import ExactGRPOTrainer

    out = []
    for run in runs:
        run = dict(run)
        stage, offload, stock = run.pop("stage"), run.pop("offload"), run.pop("stock")
        result = {}
        for cls in (ExactGRPOTrainer, GRPOTrainer) if stock else (ExactGRPOTrainer,):
            trainer = cases.run(
                cls,
                dtype=torch.float32,
                recorder=Recorder,
                deepspeed=trainer_config(stage, offload=offload),
                **run,
            )
            engine = type(trainer.model_wrapped).__name__
            counters = getattr(trainer, "fb_counters", None)
            result[cls.__name__] = {
                "steps": trainer._recorder.steps,
                "config": cases.settings(trainer),
                "engine": engine,
                "counters": None
                if counters is None
                else (counters.steps, counters.skipped_windows),
            }
        out.append(result)
    return out


def refuse_stage0(rank: int, world: int) -> str:
    """ExactGRPOTrainer with a ZeRO stage 0 config: the refusal's message."""
    from trl import GRPOConfig

    from fullbatch.trl import ExactGRPOTrainer

    config = GRPOConfig(
        output_dir="unused",
        use_cpu=True,
        report_to=[],
        bf16=False,
        loss_type="dapo",
        deepspeed=trainer_config(0),
    )
    try:
        ExactGRPOTrainer(
            model=cases.policy(dtype=torch.float32),
            reward_funcs=cases.reward,
            args=config,
            train_dataset=cases.dataset(),
            processing_class=cases.tokenizer(),
        )
    except ValueError as exc:
        return str(exc)
    return "accepted"


def skip(rank: int, world: int, stage: int) -> dict[str, Any]:
    """Three DAPO windows, the second one's loss NaN (on the last rank): whole parameters and
    the learning rate at each step's start and after training, the counters (cases.run keeps
    warnings quiet: the warning's text is tested with every wing)."""
    import math

    from fullbatch.trl import ExactGRPOTrainer

    class Poisoned(ExactGRPOTrainer):
        def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
            loss = super()._compute_loss(model, inputs)
            poison = self.state.global_step == 1 and rank == world - 1
            return loss * math.nan if poison else loss

    trainer = cases.run(
        Poisoned,
        dtype=torch.float32,
        recorder=Recorder,
        loss_type="dapo",
        steps_per_generation=2,
        gradient_accumulation_steps=2,
        max_steps=3,
        lr_scheduler_type="linear",
        deepspeed=trainer_config(stage),
    )
    steps = trainer._recorder.steps
    return {
        "snaps": [(s["params"], s["lr"]) for s in steps] + [(_full(trainer), math.nan)],
        "counters": (trainer.fb_counters.steps, trainer.fb_counters.skipped_windows),
    }

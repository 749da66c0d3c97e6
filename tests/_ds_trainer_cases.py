"""Rank functions for the Hugging Face Trainer on DeepSpeed (test_deepspeed_trainer.py).

Each run trains one epoch of real text rows (tests/_hf_cases.py) with a DeepSpeed config
(tests/_dist_ds.py ``trainer_config``), float32, SGD, ``gradient_accumulation_steps=4`` of 2
rows per rank, and returns the full parameters after every optimizer step (ZeRO-3 partitions
them: read with ``safe_get_full_fp32_param``), the rows each micro-batch held, the logged
losses and the trainer's counters.
"""

from __future__ import annotations

import tempfile
import warnings
from typing import Any

import torch

import _hf_cases as h
from _dist_ds import trainer_config

K, BATCH = 4, 2


def _model(kind: str) -> torch.nn.Module:
    return (h.llama() if kind == "causal_lm" else h.bert("masked_lm")).float()


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    for name, p in model.named_parameters():
        full = safe_get_full_fp32_param(p)
        out[name] = (p if full is None else full).detach().double().clone()
    return out


def train(run: tuple[Any, ...], rows: list[Any]) -> dict[str, Any]:
    """``run = (stage, offload, collator kind, exact loss kind or None, gradient_clipping)``."""
    from transformers import Trainer, TrainerCallback

    stage, offload, kind, exact, clip = run
    steps: list[dict[str, torch.Tensor]] = []

    class Record(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            steps.append(full_params(kw["model"]))

    collator = h.Collator(kind)
    loss_kind = "causal_lm" if kind in ("causal_lm", "first_two_ignored") else kind
    with tempfile.TemporaryDirectory() as tmp:
        args = h.training_args(
            tmp, k=K, batch=BATCH, deepspeed=trainer_config(stage, offload=offload, clip=clip)
        )
        kwargs: dict[str, Any] = dict(
            model=_model(loss_kind),
            args=args,
            train_dataset=rows,
            data_collator=collator,
            callbacks=[Record()],
        )
        if exact is None:
            trainer: Any = Trainer(**kwargs)
        else:
            from fullbatch.hf import ExactTrainer

            trainer = ExactTrainer(**kwargs, loss=exact)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            h.in_order(trainer).train()
    return {
        "steps": steps,
        "seen": collator.seen,
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        "engine_clip": trainer.model_wrapped.gradient_clipping(),
        "counters": (
            (trainer.fb_counters.steps, trainer.fb_counters.skipped_windows)
            if exact is not None
            else None
        ),
        "lr": [g["lr"] for g in trainer.optimizer.param_groups],
        "warnings": [str(w.message) for w in caught if "was skipped" in str(w.message)],
    }


def train_all(
    rank: int,
    world: int,
    runs: list[tuple[Any, ...]],
    n_rows: int,
    moe_stages: tuple[int, ...] = (),
) -> dict[Any, Any]:
    """Every run of ``runs``, then (keyed ``("moe", stage)``) :func:`moe_step` per stage."""
    rows = h.text_rows(n_rows)
    out: dict[Any, Any] = {run: train(run, rows) for run in runs}
    out.update({("moe", stage): moe_step(world, stage) for stage in moe_stages})
    return out


MOE_LENGTHS = (7, 3, 5, 7, 2, 6, 4, 1)  # real tokens per row: uneven micro-batches of 2 rows


def moe_step(world: int, stage: int) -> list[torch.Tensor]:
    """One ExactTrainer step (SGD lr=1) of a tiny float32 Mixtral with its router aux loss on,
    at ZeRO ``stage``: 2 rows per micro-batch, the 8 rows of :data:`MOE_LENGTHS` one window
    over the ranks; the full parameters' change (the applied gradient), in parameter order.
    Under ZeRO-3 the routing pre-pass's forwards gather the partitioned parameters on every
    rank."""
    from transformers import TrainerCallback

    from _moe_cases import _collate, make_moe, moe_rows
    from fullbatch.hf import ExactTrainer

    model = make_moe("mixtral").float()
    model.config.output_router_logits = True
    before = [p.detach().double().clone() for p in model.parameters()]
    window = moe_rows(MOE_LENGTHS, seed=1)
    data = [{k: v[i] for k, v in window.items()} for i in range(len(MOE_LENGTHS))]
    after: list[dict[str, torch.Tensor]] = []

    class Record(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            after.append(full_params(kw["model"]))

    with tempfile.TemporaryDirectory() as tmp:
        args = h.training_args(
            tmp,
            k=len(MOE_LENGTHS) // (2 * world),
            batch=2,
            learning_rate=1.0,
            max_steps=1,
            deepspeed=trainer_config(stage),
        )
        trainer = ExactTrainer(
            model=model,
            args=args,
            train_dataset=data,
            data_collator=_collate,
            callbacks=[Record()],
            loss="causal_lm",
        )
        h.in_order(trainer).train()
    (params,) = after
    return [b - p for b, p in zip(before, params.values(), strict=True)]


def refusals(rank: int, world: int) -> dict[str, str]:
    """ExactTrainer's refusals of DeepSpeed configs it cannot make exact (the messages)."""
    from fullbatch.hf import ExactTrainer

    out = {}
    cases = {
        "stage0_bf16": (0, "auto", 0.0, {"bf16": {"enabled": True}}),
        "clip_absent": (2, None, 0.0, {}),
        "clip_differs": (2, 0.5, 1.0, {}),
    }
    for name, (stage, clip, max_norm, extra) in cases.items():
        with tempfile.TemporaryDirectory() as tmp:
            args = h.training_args(
                tmp,
                k=K,
                batch=BATCH,
                max_grad_norm=max_norm,
                deepspeed={**trainer_config(stage, clip=clip), **extra},
            )
            try:
                ExactTrainer(
                    model=_model("causal_lm"),
                    args=args,
                    train_dataset=h.text_rows(8),
                    data_collator=h.Collator("causal_lm"),
                    loss="causal_lm",
                )
                out[name] = "accepted"
            except ValueError as exc:
                out[name] = str(exc)
    return out


def skips(rank: int, world: int, stage: int) -> dict[str, Any]:
    """Three windows of the causal LM with a linear LR schedule; window 1 poisoned: a NaN loss
    on the last rank's second micro-batch, or every label -100 (no items) on every rank. The
    full parameters after every step, the learning rate each step uses, the counters, the
    warnings."""
    return {mode: _poisoned(rank, world, stage, mode) for mode in ("nan", "no_items")}


def _poisoned(rank: int, world: int, stage: int, mode: str) -> dict[str, Any]:
    import itertools

    from transformers import TrainerCallback

    from fullbatch.hf import ExactTrainer

    steps: list[dict[str, torch.Tensor]] = []
    lrs: list[float] = []

    class Record(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            lrs.append(float(kw["optimizer"].param_groups[0]["lr"]))  # what this step uses

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            steps.append(full_params(kw["model"]))

    class Poisoned(ExactTrainer):
        def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> Any:
            if mode == "no_items" and self.state.global_step == 1:
                epoch_iterator = (
                    {**b, "labels": torch.full_like(b["labels"], -100)}
                    for b in itertools.islice(epoch_iterator, num_batches)
                )
            return super().get_batch_samples(epoch_iterator, num_batches, device)

        def exact_loss(self, model: Any, inputs: dict[str, Any]) -> tuple[Any, Any]:
            loss_sum, n = super().exact_loss(model, inputs)
            window = self._fb_window
            poison = self.state.global_step == 1 and window is not None
            if mode == "nan" and poison and window.index == 1 and rank == world - 1:
                loss_sum = loss_sum * float("nan")
            return loss_sum, n

    with tempfile.TemporaryDirectory() as tmp:
        args = h.training_args(
            tmp, k=K, batch=BATCH, lr_scheduler_type="linear", deepspeed=trainer_config(stage)
        )
        trainer = Poisoned(
            model=_model("causal_lm"),
            args=args,
            train_dataset=h.text_rows(3 * K * BATCH * world),
            data_collator=h.Collator("causal_lm"),
            callbacks=[Record()],
            loss="causal_lm",
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            h.in_order(trainer).train()
    return {
        "steps": steps,
        "lrs": lrs,
        "counters": (trainer.fb_counters.steps, trainer.fb_counters.skipped_windows),
        "warnings": [str(w.message) for w in caught if "was skipped" in str(w.message)],
    }

"""One optimizer step of TRL's SFT trainers on a tiny transformers MoE model (tests/_moe_cases.py):
pre-tokenized rows with padding, a plain collator, SGD(lr=1), no clipping; the parameter
change (the applied gradient). Module-level functions: importable by the forkserver ranks."""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from _moe_cases import make_moe, moe_rows, update

KEYS = ("input_ids", "attention_mask", "labels")


def collate(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The rows as they are (right-padded to the same width by :func:`moe_rows`)."""
    return {k: torch.stack([torch.as_tensor(r[k]) for r in rows]) for k in KEYS}


def sft_step(
    model: nn.Module,
    trainer_cls: Any,
    out_dir: str,
    lengths: Sequence[int],
    k: int,
    batch: int = 2,
    quiet: bool = True,
    **kw: Any,
) -> tuple[list[torch.Tensor], Any]:
    """One step of ``trainer_cls`` (``trl.SFTTrainer`` or ``ExactSFTTrainer``) over
    :func:`moe_rows` ``(lengths, seed=1)``, ``batch`` rows per micro-batch, ``k`` micro-batches
    per window on each rank (the last may hold fewer); the applied gradient and the trainer.
    ``quiet``: warnings raised while it trains are dropped."""
    from datasets import Dataset
    from trl import SFTConfig

    from fullbatch._demo._trl_tiny import char_tokenizer

    rows = moe_rows(lengths, seed=1)
    data = Dataset.from_list(
        [{k: v[i].tolist() for k, v in rows.items()} for i in range(len(lengths))]
    )
    args = SFTConfig(
        out_dir,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=k,
        max_steps=1,
        learning_rate=1.0,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        use_cpu=True,
        bf16=False,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        remove_unused_columns=False,
        train_sampling_strategy="sequential",
        dataset_kwargs={"skip_prepare_dataset": True},
        **kw,
    )
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with warnings.catch_warnings():
        if quiet:  # TRL's and transformers' notices; quiet=False lets fullbatch's through
            warnings.simplefilter("ignore")
        trainer = trainer_cls(
            model=model,
            args=args,
            train_dataset=data,
            data_collator=collate,
            processing_class=char_tokenizer(),
            optimizers=(opt, None),
        )
        trainer.train()
    return update(before, model), trainer


def sft_rank(rank: int, world: int, family: str, lengths: Sequence[int]) -> dict[str, Any]:
    """One rank of the ExactSFTTrainer MoE DDP test (the gloo group is up: tests/_dist.py)."""
    from fullbatch.trl import ExactSFTTrainer

    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="1",  # never used: accelerate finds the process group initialized
        OMP_NUM_THREADS="1",
    )
    with tempfile.TemporaryDirectory() as out:
        k = len(lengths) // (2 * world)
        got, trainer = sft_step(make_moe(family), ExactSFTTrainer, out, lengths, k)
    assert trainer.accelerator.num_processes == world
    aux = [h["aux_loss"] for h in trainer.state.log_history if "aux_loss" in h]
    return {"update": got, "aux_loss": aux}


def sft_trainer(trainer_cls: Any, out_dir: str, lengths: Sequence[int], k: int) -> Any:
    """An untrained ``trainer_cls`` on a tiny Mixtral over :func:`moe_rows` ``(lengths)``, 2
    rows per micro-batch, ``k`` per window (for ``fullbatch.hf.check_trainer``)."""
    from datasets import Dataset
    from trl import SFTConfig

    from fullbatch._demo._trl_tiny import char_tokenizer

    rows = moe_rows(lengths, seed=1)
    data = Dataset.from_list(
        [{k: v[i].tolist() for k, v in rows.items()} for i in range(len(lengths))]
    )
    args = SFTConfig(
        out_dir,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=k,
        use_cpu=True,
        bf16=False,
        report_to=[],
        remove_unused_columns=False,
        dataset_kwargs={"skip_prepare_dataset": True},
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trainer_cls(
            model=make_moe("mixtral"),
            args=args,
            train_dataset=data,
            data_collator=collate,
            processing_class=char_tokenizer(),
        )

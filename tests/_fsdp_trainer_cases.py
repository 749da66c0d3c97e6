"""Rank functions for the Hugging Face Trainer's FSDP configurations (test_hf_fsdp.py).

Two gloo ranks on CPU, a tiny float64 Llama, ``gradient_accumulation_steps=2`` of 4 rows per
rank (tests/_hf_cases.py ``run``). Each rank returns its parameters after every step (whole
tensors: FSDP2's DTensors are gathered), the rows it read and what the Trainer built:

- ``config``: ``fsdp="full_shard", fsdp_config={"fsdp_version": 2}``, the Trainer's FSDP2
  configuration. On a CPU machine Accelerate keeps ``DistributedType.MULTI_CPU`` (it turns FSDP
  on for GPU-like devices only), stores no FSDP plugin, and wraps the model in DDP;
- ``loaded``: a model sharded with FSDP2 (``fully_shard`` over a 1-D mesh of both ranks) by
  ``from_pretrained(path, distributed_config=DistributedConfig(fsdp_size=2))``, which the Trainer
  does not wrap: a real FSDP2 model in the Trainer's loop on CPU (non-final micro-batches under
  ``set_requires_gradient_sync(False)``, sharded ``.grad`` after the last).
"""

from __future__ import annotations

import os
from typing import Any

import torch

import _hf_cases as h

K, BATCH, ROWS = 2, 4, 40


def _env(rank: int, world: int) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="1",  # never used: accelerate finds the process group initialized
        OMP_NUM_THREADS="1",
    )


def _whole(steps: list[dict[str, Any]]) -> list[dict[str, torch.Tensor]]:
    """Each step's parameters as whole tensors (DTensors gathered)."""
    return [
        {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in step.items()}
        for step in steps
    ]


def train(rank: int, world: int, route: str, exact: bool, path: str) -> dict[str, Any]:
    """One epoch: ``route`` ``"config"`` or ``"loaded"`` (the module docstring), ExactTrainer
    (``exact``) or the stock Trainer; ``path``: the saved tiny Llama ``"loaded"`` reads."""
    _env(rank, world)
    from torch.distributed.fsdp import FSDPModule
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    def sharded() -> torch.nn.Module:
        config = DistributedConfig(fsdp_size=world)
        return AutoModelForCausalLM.from_pretrained(
            path, distributed_config=config, dtype=torch.float64
        )

    overrides = {"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2}}
    result = h.run(
        h.llama if route == "config" else sharded,
        h.text_rows(ROWS),
        "causal_lm",
        k=K,
        batch=BATCH,
        exact="causal_lm" if exact else None,
        **(overrides if route == "config" else {}),
    )
    trainer = result.pop("trainer")
    wrapped = trainer.model_wrapped
    result["steps"] = _whole(result["steps"])
    result["ddp"] = isinstance(wrapped, torch.nn.parallel.DistributedDataParallel)
    result["fsdp2"] = isinstance(wrapped, FSDPModule)
    result["distributed_type"] = str(trainer.accelerator.distributed_type)
    result["is_fsdp_enabled"] = trainer.is_fsdp_enabled
    counters = getattr(trainer, "fb_counters", None)
    result["counters"] = None if counters is None else (counters.steps, counters.skipped_windows)
    return result


def train_all(rank: int, world: int, runs: list[tuple[str, bool]], path: str) -> dict[Any, Any]:
    return {run: train(rank, world, *run, path) for run in runs}


def shard_norm(rank: int, world: int) -> dict[str, Any]:
    """A ``fully_shard``'ed Linear whose gradient shards are set by hand (an inf on rank 1's
    shard only): what the Trainer wings' window read gives on every rank."""
    from torch.distributed.fsdp import fully_shard

    from fullbatch._base._sync import sum_over_ranks
    from fullbatch._base._sync._fsdp import fsdp_divisor
    from fullbatch._wings._close import read_totals

    torch.manual_seed(0)
    model = fully_shard(torch.nn.Linear(4, 6, dtype=torch.float64))
    out: dict[str, Any] = {"divisor": fsdp_divisor(model)}
    for poison in (False, True):
        for p in model.parameters():
            local = torch.full_like(p.to_local(), float(rank + 1))
            if poison and rank == 1:
                local.view(-1)[0] = float("inf")
            p.grad = torch.distributed.tensor.DTensor.from_local(
                local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
            )
        grads = [p.grad for p in model.parameters()]
        whole = sum(float(g.full_tensor().pow(2).sum()) for g in grads)
        local_sums = torch.zeros(1, dtype=torch.float64)
        _, sharded = read_totals(local_sums, grads, sum_over_ranks, shard_copies=1.0)
        _, replicated = read_totals(local_sums.clone(), grads, sum_over_ranks)
        out[poison] = (whole, sharded, replicated)
    return out

"""Shared by the Accelerate tests: variable-length rows, the plain-PyTorch full-batch
reference, and the function each gloo rank runs (importable by the forkserver)."""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

import fullbatch as fb
from conftest import IGNORE, lm_batch, make_lm, ref_mean_loss

ROWS = 44  # 2 full windows of 16 rows, then a partial one of 12 (single process)
WIDTH = 12
MICRO_ROWS = 4
MICRO_BATCHES = 4
LR = 0.5


def rows(n: int = ROWS, seed: int = 3) -> list[dict[str, torch.Tensor]]:
    """``n`` right-padded rows of random lengths, 20% of real labels ignored, and an ``idx``."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, WIDTH + 1, (n,), generator=g).tolist()
    batch = lm_batch(lengths, seed=seed, width=WIDTH, ignore_frac=0.2)
    return [{**{k: v[i] for k, v in batch.items()}, "idx": torch.tensor(i)} for i in range(n)]


def loader(data: Sequence[dict[str, torch.Tensor]], batch_size: int = MICRO_ROWS) -> DataLoader:
    return DataLoader(list(data), batch_size=batch_size, shuffle=False)


def stack(data: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([r[k] for r in data]) for k in data[0]}


def reference_run(
    model: nn.Module,
    windows: Sequence[Sequence[dict[str, torch.Tensor]]],
    *,
    max_grad_norm: float | None = None,
    gamma: float = 1.0,
    scheduler_steps: int = 1,
) -> list[list[torch.Tensor]]:
    """Plain PyTorch, one full batch per window: a mean loss, one backward, one step.

    Returns the parameters after every step.
    """
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=gamma)
    out = []
    for window in windows:
        ref_mean_loss(ref, stack(window)).backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), max_grad_norm)
        opt.step()
        for _ in range(scheduler_steps):
            sched.step()
        opt.zero_grad(set_to_none=True)
        out.append([p.detach().clone() for p in ref.parameters()])
    return out


def lm_loss(model: nn.Module, micro: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return fb.causal_lm_loss(model(micro["input_ids"]), micro["labels"])


def mean_loss(model: nn.Module, micro: dict[str, torch.Tensor]) -> torch.Tensor:
    """What ``outputs.loss`` is for a Hugging Face causal LM: the micro-batch's mean."""
    logits = model(micro["input_ids"])
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]),
        micro["labels"][:, 1:].reshape(-1),
        ignore_index=IGNORE,
    )


# -- 2 gloo ranks ----------------------------------------------------------------------------


def _accelerator_env(rank: int, world: int) -> None:
    """What PartialState reads; the gloo group is already initialized by tests/_dist.py."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        OMP_NUM_THREADS="1",
    )


def ddp_rank(rank: int, world: int, n_rows: int, even_batches: bool) -> dict[str, Any]:
    """Prepare model, optimizer, scheduler and loader with Accelerate; train with fullbatch.

    Returns the parameters after every step, the row indices this rank read per window, the
    number of gradient all-reduces (DDP comm hook calls) and of windows, or the error.
    """
    _accelerator_env(rank, world)
    from accelerate import Accelerator, DataLoaderConfiguration
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    accelerator = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(even_batches=even_batches)
    )
    model = make_lm()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, dl, sched = accelerator.prepare(model, opt, loader(rows(n_rows)), sched)
    out: dict[str, Any] = {
        "ddp": isinstance(model, nn.parallel.DistributedDataParallel),
        "processes": accelerator.num_processes,
        "read": [int(i) for batch in dl for i in batch["idx"]],
    }
    calls = {"grad": 0}

    def counting(state, bucket):  # type: ignore[no-untyped-def]  (DDP checks annotations)
        calls["grad"] += 1
        return default_hooks.allreduce_hook(state, bucket)

    model.register_comm_hook(None, counting)
    acc = fb.Accumulator(model, opt, micro_batches=MICRO_BATCHES, scheduler=sched)
    try:
        windows = acc.windows(dl)
    except ValueError as error:
        out["error"] = str(error)
        return out
    out["params"], out["windows"], out["micro"] = [], [], []
    with acc:
        for window in windows:
            seen = []
            for micro in window:
                seen += [int(i) for i in micro["idx"]]
                window.backward(*lm_loss(model, micro))
            out["micro"].append(len(window))
            window.step()
            out["windows"].append(seen)
            out["params"].append([p.detach().clone() for p in model.module.parameters()])
    out["grad_syncs"] = calls["grad"]
    out["last_epoch"] = sched.scheduler.last_epoch
    return out


def ddp_leftover_accumulate(rank: int, world: int) -> dict[str, Any]:
    """``accelerator.accumulate(model)`` left in the loop after gradient_accumulation_steps was
    raised to 3: on fullbatch's 4th (final) micro-batch Accelerate enters DDP's no_sync().
    Returns this rank's gradient after the final backward and the error at the step."""
    _accelerator_env(rank, world)
    from accelerate import Accelerator, DataLoaderConfiguration

    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration())
    model = make_lm()
    start = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model, opt, dl = accelerator.prepare(model, opt, loader(rows(48)))
    out: dict[str, Any] = {}
    with fb.Accumulator(model, opt, micro_batches=MICRO_BATCHES) as acc:
        accelerator.gradient_accumulation_steps = 3
        try:
            for window in acc.windows(dl):
                for micro in window:
                    with accelerator.accumulate(model):
                        window.backward(*lm_loss(model, micro))
                out["grad"] = model.module.out.weight.grad.clone()
                window.step()
        except RuntimeError as error:
            out["error"] = str(error)
    now = [p.detach() for p in model.module.parameters()]
    out["moved"] = any(not torch.equal(a, b) for a, b in zip(start, now, strict=True))
    return out

"""Objects prepared by Hugging Face Accelerate, recognised without importing it.

``accelerator.prepare(model, optimizer, loader, scheduler)`` hands back wrappers that change
what fullbatch's plain-object logic relies on:

- ``AcceleratedOptimizer`` subclasses ``torch.optim.Optimizer`` without running its
  ``__init__``: it has no step hooks, and its ``step()`` / ``zero_grad()`` do nothing while
  Accelerate's ``gradient_state.sync_gradients`` is false (inside ``accelerator.accumulate``).
  fullbatch hooks, steps and clears the optimizer it wraps (``.optimizer``). A stray
  ``optimizer.step()`` on the wrapper reaches the inner optimizer, whose hook refuses it.
- ``AcceleratedScheduler`` has no ``last_epoch``: the stray-``scheduler.step()`` guard
  watches the scheduler it wraps, while fullbatch steps the wrapper (Accelerate's own rule:
  ``num_processes`` inner steps per optimizer step unless ``split_batches``).
- A leftover ``accelerator.accumulate(model)`` with ``gradient_accumulation_steps > 1``
  enters DDP's ``no_sync()`` around forwards fullbatch meant to synchronize; it leaves
  ``sync_gradients`` false, which the step checks.
- A prepared ``DataLoader`` with ``even_batches=True`` (the default) completes the last
  batches with rows from the start of the data so every process gets as many full batches:
  those rows would count twice in the window. :func:`check_loader` refuses it.

Everything is duck-typed on the wrapper's class name and attributes.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["Prepared", "check_loader"]


def _accelerate(obj: Any, name: str) -> bool:
    cls = type(obj)
    return cls.__name__ == name and cls.__module__.startswith("accelerate.")


class Prepared:
    """The inner optimizer and scheduler behind Accelerate's wrappers (plain ones pass through).

    >>> import torch
    >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    >>> prepared = Prepared(opt, None, None)
    >>> prepared.optimizer is opt, prepared.gradient_state is None
    (True, True)
    """

    def __init__(self, optimizer: Any, scheduler: Any, scaler: Any) -> None:
        self.gradient_state: Any = None
        wrapper_scaler = None
        while _accelerate(optimizer, "AcceleratedOptimizer"):
            self.gradient_state = optimizer.gradient_state
            wrapper_scaler = wrapper_scaler or optimizer.scaler
            optimizer = optimizer.optimizer
        self.optimizer = optimizer
        steps = getattr(self.gradient_state, "num_steps", 1)
        if steps != 1:
            raise ValueError(
                f"the optimizer was prepared by an Accelerator with gradient_accumulation_steps="
                f"{steps}: accelerator.backward() would divide every loss by {steps} and "
                "accelerator.accumulate() would turn off DDP's gradient sync behind fullbatch. "
                "Build the Accelerator with gradient_accumulation_steps=1 (the default) and "
                "drop accumulate(): fullbatch's windows do the accumulation."
            )
        if wrapper_scaler is not None and wrapper_scaler.is_enabled() and scaler is None:
            raise ValueError(
                "the optimizer was prepared by an Accelerator with a GradScaler "
                "(mixed_precision='fp16'), but no scaler was given to the Accumulator: the "
                "loss would not be scaled and small fp16 gradients would flush to zero. Pass "
                "scaler=accelerator.scaler."
            )
        if wrapper_scaler is not None and scaler is not None and scaler is not wrapper_scaler:
            raise ValueError(
                f"scaler={scaler!r} is not the GradScaler the Accelerator prepared the "
                "optimizer with; pass scaler=accelerator.scaler."
            )
        # The guard watches last_epoch, which Accelerate's wrapper does not have.
        self.watched_scheduler = scheduler
        while _accelerate(self.watched_scheduler, "AcceleratedScheduler"):
            self.watched_scheduler = self.watched_scheduler.scheduler
        _check_scheduled(self.watched_scheduler, optimizer)

    def step_message(self, index: int) -> str | None:
        """Why the window must not step, if Accelerate's accumulation state says so."""
        state = self.gradient_state
        if state is None or state.sync_gradients:
            return None
        return (
            f"Accelerate's gradient_state.sync_gradients is False at the step of window "
            f"{index}: a leftover `with accelerator.accumulate(model):` with "
            f"gradient_accumulation_steps={state.num_steps} is in the loop. Under DDP it "
            "enters model.no_sync() around micro-batches fullbatch synchronizes, so ranks "
            "would step with their own gradients. The window was discarded. Delete the "
            "accumulate() context and build the Accelerator with gradient_accumulation_steps=1 "
            "(the default): fullbatch's windows do the accumulation."
        )


def _check_scheduled(scheduler: Any, optimizer: Any) -> None:
    """Refuse a scheduler whose optimizer is not the one fullbatch steps (a re-created one).

    A wrapper that shares its param groups with the optimizer (Accelerate's, Lookahead-style)
    is the same optimizer for this purpose.

    >>> import torch
    >>> w = [torch.nn.Parameter(torch.zeros(1))]
    >>> old, new = torch.optim.SGD(w, lr=0.1), torch.optim.SGD(w, lr=0.2)
    >>> _check_scheduled(torch.optim.lr_scheduler.StepLR(old, 1), old)
    >>> try:
    ...     _check_scheduled(torch.optim.lr_scheduler.StepLR(old, 1), new)
    ... except ValueError as error:
    ...     print(str(error).split(" than")[0])
    scheduler= changes the learning rate of another optimizer (SGD, lr=0.1)
    """
    scheduled = getattr(scheduler, "optimizer", None)
    groups = getattr(scheduled, "param_groups", None)
    if scheduled is None or scheduled is optimizer or not isinstance(groups, list):
        return
    ours = {id(group) for group in optimizer.param_groups}
    if any(id(group) in ours for group in groups):
        return
    theirs = groups[0].get("lr") if groups else None
    mine = optimizer.param_groups[0].get("lr") if optimizer.param_groups else None
    raise ValueError(
        f"scheduler= changes the learning rate of another optimizer "
        f"({type(scheduled).__name__}, lr={theirs}) than the one the Accumulator steps "
        f"({type(optimizer).__name__}, lr={mine}): its schedule would never apply (an "
        "optimizer re-created after the scheduler or the Accumulator?). Build the scheduler "
        "on the optimizer you pass, e.g. `scheduler = torch.optim.lr_scheduler.LambdaLR("
        "optimizer, ...)`, then `fb.Accumulator(model, optimizer, scheduler=scheduler, ...)`."
    )


def _rows(loader: Any, shard: Any) -> int | None:
    """The rows the loader's sampler draws from (a custom sampler may draw a subset)."""
    sources: list[Any] = [getattr(shard.batch_sampler, "sampler", None), loader.dataset]
    for source in sources:
        try:
            return len(source)
        except TypeError:
            continue
    return None


def check_loader(loader: Any) -> None:
    """Refuse an Accelerate-prepared loader that repeats rows to even out processes.

    Raises:
        ValueError: ``even_batches=True`` and the data does not split into equally many
            full batches per process, so Accelerate adds rows from the start of the data.
    """
    if not _accelerate(loader, "DataLoaderShard"):
        return
    shard: Any = getattr(loader, "batch_sampler", None)
    if not _accelerate(shard, "BatchSamplerShard"):
        return
    processes = int(shard.num_processes)
    if processes == 1 or not shard.even_batches or shard.drop_last:
        return
    size = shard.batch_size
    if size is None:  # a batch sampler of varying batch sizes: whole batches are repeated
        batches = len(shard.batch_sampler)
        repeated = -batches % processes
        what = f"{repeated} batch(es) from the start"
    else:
        rows = _rows(loader, shard)
        if rows is None:
            return
        per_round = size if shard.split_batches else size * processes
        repeated = math.ceil(rows / per_round) * per_round - rows
        what = f"{repeated} row(s) from the start of the data to its {rows} rows"
    if repeated == 0:
        return
    raise ValueError(
        f"this loader was prepared by Accelerate with even_batches=True over {processes} "
        f"processes: to give every process equally many full batches it adds {what}, which "
        "would count twice in fullbatch's windows (an objective that is not the full "
        "batch's). fullbatch handles processes with fewer micro-batches itself: build the "
        "Accelerator with dataloader_config=DataLoaderConfiguration(even_batches=False), or "
        "use DataLoader(drop_last=True)."
    )

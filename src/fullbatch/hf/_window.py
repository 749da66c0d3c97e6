"""The window of a ``transformers.Trainer`` wing, from ``get_batch_samples`` to its close.

:class:`TrainerWindow` (one process, DDP, FSDP2) records each micro-batch in a wing window,
backpropagates ``c · loss_sum`` through ``accelerator.backward`` and, after the last, closes
it: every gradient times ``W / (c · N)``, ``W`` being Accelerate's ``1 / GA`` times the
wrapper's division; the Trainer clips and steps afterwards. A skip drops every ``.grad``
(:func:`keep_schedule`) and returns the LR schedule to put back (:class:`Ended`), which the
trainer restores after its scheduler step (:class:`KeepSchedule`). A window writes nothing on
its trainer: ``c``, the kept schedule and the counters are the trainer's plain attributes, so
``fullbatch.hf.check_trainer``, which restores them, leaves no trace.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import TrainerCallback

from fullbatch._base._schedule import KeptSchedule
from fullbatch._base._sync._fsdp import fsdp_divisor, is_fsdp
from fullbatch._base._verdict import NONFINITE_GRADIENT, Verdict, WindowCounters, WindowTotals
from fullbatch._wings._close import Wing, close_window, skip_framework_step
from fullbatch._wings._window import WingWindow

__all__ = [
    "THROUGH",
    "Ended",
    "KeepSchedule",
    "TrainerWindow",
    "WindowCounters",
    "end_trainer_window",
    "keep_schedule",
    "layout",
    "restored",
    "summed",
    "wing",
]

# The frameworks between the user's trainer.train() and a Trainer wing's window end.
THROUGH = ("transformers", "accelerate", "trl", "torch", "deepspeed")
REPORT = "trainer.fb_counters.skipped_windows"
COUNT_FIX = "exact_loss must return the number of items its sum holds."


def wing(trainer: Any) -> Wing:
    """The Trainer wings' :class:`Wing`: their counters, the report, a GradScaler."""
    scaler = getattr(trainer.accelerator, "scaler", None) is not None
    return Wing(trainer.fb_counters, REPORT, THROUGH, scaler=scaler)


def keep_schedule(trainer: Any, params: list[Any], keep_grads: bool = False) -> KeptSchedule:
    """Skip the Trainer's coming optimizer step (``params``' gradients dropped); the LR
    schedule to put back after the Trainer's scheduler step (:class:`KeepSchedule`)."""
    optimizer = trainer.optimizer
    groups = [] if optimizer is None else optimizer.param_groups
    return skip_framework_step(params, [trainer.lr_scheduler], groups, keep_grads=keep_grads)


@dataclass(frozen=True)
class Ended:
    """What a Trainer window's close leaves its trainer: the verdict, the window's
    ``[loss_sum, count, *extras]`` over all ranks and, after a skip, the schedule to put back."""

    verdict: Verdict
    values: list[float]
    kept: KeptSchedule | None


def end_trainer_window(
    trainer: Any, model: torch.nn.Module, totals: WindowTotals
) -> tuple[Verdict, KeptSchedule | None]:
    """Decide the window, then normalize its gradients (the Trainer clips afterwards), or skip
    it the Trainer's way (the schedule to put back is returned)."""
    close = wing(trainer)
    params = list(model.parameters())
    kept: list[KeptSchedule] = []

    def skip(verdict: Verdict) -> None:
        grads_kept = close.scaler and verdict.reason == NONFINITE_GRADIENT
        kept.append(keep_schedule(trainer, params, grads_kept))

    grads = [p.grad for p in params if p.grad is not None]
    return close_window(totals, close, grads, skip), (kept[0] if kept else None)


def layout(trainer: Any, model: torch.nn.Module) -> tuple[float, float | None]:
    """``(what the wrapper divides the summed gradient by, ranks per gradient shard or None
    for a replicated gradient)``."""
    world = trainer.accelerator.num_processes
    if is_fsdp(model):
        return fsdp_divisor(model)
    if world > 1 and not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise RuntimeError(
            f"{world} processes but the model is {type(model).__name__}, neither "
            "DistributedDataParallel nor FSDP2 (fully_shard): fullbatch's Trainer wings know "
            "those wrappers' gradient division only."
        )
    return float(world), None


def summed(trainer: Any) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The trainer's sum over its processes (``None`` on one)."""
    accelerator = trainer.accelerator
    if accelerator.num_processes == 1:
        return None
    return lambda t: accelerator.reduce(t, reduction="sum")


class TrainerWindow:
    """One window: its micro-batches' numbers (a wing window), their backward, the close."""

    def __init__(self, trainer: Any, batches: list[Any], loss_scale: float = 1.0) -> None:
        self.size = len(batches)
        self.done = 0  # micro-batches begun
        # c: a power of two <= 1 / N of the previous window, on every rank
        self.numbers = WingWindow(loss_scale, device=trainer.args.device)

    @property
    def c(self) -> float:
        return self.numbers.loss_scale

    @property
    def index(self) -> int:
        """The position of the micro-batch being run."""
        return self.done - 1

    def advance(self, sync: bool) -> bool:
        """Begin the next micro-batch; whether it ends the window (``sync``: the Trainer's)."""
        if self.done >= self.size:
            raise RuntimeError(
                "ExactTrainer.training_step ran outside a window: the Trainer's loop reads each "
                "window with get_batch_samples first. Call trainer.train(), or "
                "get_batch_samples(...) before the window's training_step calls."
            )
        self.done += 1
        last = self.done == self.size
        if sync != last:
            raise RuntimeError(
                f"the Trainer syncs gradients at micro-batch {'not ' if last else ''}ending the "
                "window ExactTrainer read: the loop and get_batch_samples disagree."
            )
        return last

    def record(self, loss_sum: torch.Tensor, count: torch.Tensor, extras: list[Any]) -> None:
        """Keep the micro-batch's ``[loss_sum, count, *extras]`` (float64, on the device)."""
        self.numbers.record(loss_sum, count, extras)

    def backward(
        self, trainer: Any, model: torch.nn.Module, loss_sum: torch.Tensor
    ) -> Ended | None:
        """Backpropagate ``c · loss_sum``; after the window's last, close it."""
        trainer.accelerator.backward(loss_sum * self.c)
        return self.close(trainer, model) if self.done == self.size else None

    def close(self, trainer: Any, model: torch.nn.Module) -> Ended:
        divisor, copies = layout(trainer, model)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        read = self.numbers.read(grads, summed(trainer), shard_copies=copies, fix=COUNT_FIX)
        totals = WindowTotals(
            loss=read.loss,
            count=read.count,
            squared_norm=read.squared_norm,
            # the wrapper's division, and Accelerate's 1 / GA in accelerator.backward
            divisor=divisor * trainer.accelerator.gradient_accumulation_steps,
            loss_scale=self.c,
        )
        verdict, kept = end_trainer_window(trainer, model, totals)
        return Ended(verdict, read.values, kept)


def restored(kept: KeptSchedule | None) -> KeptSchedule | None:
    """Put ``kept`` back (if any); what the trainer keeps next: nothing."""
    if kept is not None:
        kept.restore()
    return None


class KeepSchedule(TrainerCallback):
    """After the Trainer's scheduler step, call ``restore`` (the trainer's own method, which
    puts back the LR schedule a skipped window kept)."""

    def __init__(self, restore: Callable[[], None]) -> None:
        self.restore = restore

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.restore()

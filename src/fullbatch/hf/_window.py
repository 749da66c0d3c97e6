"""The window of a ``transformers.Trainer`` wing, from ``get_batch_samples`` to its close.

``ExactTrainer`` (and so ``ExactSFTTrainer``, ``ExactDPOTrainer``) opens a window when the
Trainer's loop reads one (``get_batch_samples``), hands it each micro-batch's summed loss and
count (:meth:`TrainerWindow.record`) and lets it backpropagate them
(:meth:`TrainerWindow.backward`); after the last it closes through the one window-close
(:mod:`fullbatch._wings._close`). Who holds the gradients decides how:

- :class:`TrainerWindow` (one process, DDP, FSDP2 — and an FSDP config that Accelerate runs
  as DDP on a CPU machine): ``c · loss_sum`` through ``accelerator.backward``, then, after the
  last backward, every gradient times ``W / (c · N)``: ``W`` is what Accelerate's ``1 / GA``
  and the wrapper divided by (DDP's ranks; FSDP2's divide factor, read as the Accumulator's
  FSDP2 route reads it), and an FSDP2 model's squared norm is its shards' summed over the
  ranks. The Trainer clips and steps afterwards;
- :class:`fullbatch.hf._deepspeed.DeepSpeedTrainerWindow`: the scale fixed up front.

The Trainer steps the optimizer and the LR scheduler after every window, so a skip is made in
its terms (:func:`fullbatch._wings._close.skip_framework_step`): every ``.grad`` set to
``None`` (with a GradScaler and a non-finite gradient, left for the scaler, which skips and
backs off) and the LR schedule kept in ``trainer._fb_schedule``, put back by
:class:`KeepSchedule` after the Trainer's scheduler step (``on_step_end``).

The trainer holds ``fb_counters``, ``_fb_c`` and ``_fb_schedule`` as plain attributes and a
fresh window per window, so ``fullbatch.hf.check_trainer``, which restores them, leaves no
trace. ``ExactGRPOTrainer`` scales its own losses and uses :func:`end_trainer_window`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import TrainerCallback

from fullbatch._base._sync._fsdp import fsdp_divisor, is_fsdp
from fullbatch._base._verdict import NONFINITE_GRADIENT, Verdict, WindowCounters, WindowTotals
from fullbatch._wings._close import Wing, close_window, read_totals, skip_framework_step

__all__ = [
    "THROUGH",
    "KeepSchedule",
    "TrainerWindow",
    "WindowCounters",
    "end_trainer_window",
    "keep_schedule",
    "read_window",
    "summed",
    "wing",
]

# The frameworks between the user's trainer.train() and a Trainer wing's window end.
THROUGH = ("transformers", "accelerate", "trl", "torch", "deepspeed")
REPORT = "trainer.fb_counters.skipped_windows"


def wing(trainer: Any) -> Wing:
    """The Trainer wings' :class:`Wing`: their counters, the report, a GradScaler."""
    scaler = getattr(trainer.accelerator, "scaler", None) is not None
    return Wing(trainer.fb_counters, REPORT, THROUGH, scaler=scaler)


def keep_schedule(trainer: Any, params: list[Any], keep_grads: bool = False) -> None:
    """Skip the Trainer's coming optimizer step (``params``' gradients dropped) and keep its
    LR schedule, put back after the Trainer's scheduler step by :class:`KeepSchedule`."""
    optimizer = trainer.optimizer
    groups = [] if optimizer is None else optimizer.param_groups
    trainer._fb_schedule = skip_framework_step(
        params, [trainer.lr_scheduler], groups, keep_grads=keep_grads
    )


def end_trainer_window(trainer: Any, model: torch.nn.Module, totals: WindowTotals) -> Verdict:
    """Decide the window, then normalize its gradients (the Trainer clips afterwards), or skip
    it the Trainer's way."""
    close = wing(trainer)
    params = list(model.parameters())

    def skip(verdict: Verdict) -> None:
        keep_schedule(trainer, params, close.scaler and verdict.reason == NONFINITE_GRADIENT)

    grads = [p.grad for p in params if p.grad is not None]
    return close_window(totals, close, grads, skip)


def _layout(model: torch.nn.Module, world: int) -> tuple[float, float | None]:
    """``(what the wrapper divides the summed gradient by, ranks per gradient shard or None
    for a replicated gradient)``."""
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


def read_window(
    trainer: Any, model: torch.nn.Module, local: torch.Tensor
) -> tuple[list[float], float, float]:
    """``local`` summed over the processes, the gradients' squared norm and what the wrapper
    divided them by, read in the window's one host sync."""
    divisor, copies = _layout(model, trainer.accelerator.num_processes)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    *values, sq = read_totals(local, grads, summed(trainer), shard_copies=copies)
    return values, sq, divisor


class TrainerWindow:
    """One window: its micro-batches' sums, their backward, the close after the last."""

    def __init__(self, trainer: Any, batches: list[Any]) -> None:
        self.size = len(batches)
        self.done = 0  # micro-batches begun
        self.c = trainer._fb_c  # the loss constant: a power of two <= 1 / N, on every rank
        self._stats: list[torch.Tensor] = []

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
        stats = [loss_sum.detach().double().reshape(1), count.reshape(1), *extras]
        self._stats.append(torch.cat([s.to(count) for s in stats]))

    def local_totals(self) -> torch.Tensor:
        return torch.stack(self._stats).sum(0)

    def backward(
        self, trainer: Any, model: torch.nn.Module, loss_sum: torch.Tensor
    ) -> Verdict | None:
        """Backpropagate ``c · loss_sum``; after the window's last, close it."""
        trainer.accelerator.backward(loss_sum * self.c)
        return self.close(trainer, model) if self.done == self.size else None

    def close(self, trainer: Any, model: torch.nn.Module) -> Verdict:
        values, sq, divisor = read_window(trainer, model, self.local_totals())
        trainer._window_end(values)
        verdict = end_trainer_window(
            trainer,
            model,
            WindowTotals(
                loss=values[0],
                count=values[1],
                squared_norm=sq,
                # the wrapper's division, and Accelerate's 1 / GA in accelerator.backward
                divisor=divisor * trainer.accelerator.gradient_accumulation_steps,
                loss_scale=self.c,
            ),
        )
        if verdict.next_loss_scale is not None:
            trainer._fb_c = verdict.next_loss_scale
        return verdict


class KeepSchedule(TrainerCallback):
    """Put the LR schedule back after the Trainer's scheduler step that followed a skip."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        kept, self.trainer._fb_schedule = self.trainer._fb_schedule, None
        if kept is not None:
            kept.restore()

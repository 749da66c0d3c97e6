"""The end of a window inside a ``transformers.Trainer``: the verdict, and how a Trainer skips.

``ExactTrainer`` (and so ``ExactSFTTrainer``, ``ExactDPOTrainer``) and ``ExactGRPOTrainer``
call :func:`end_trainer_window` after the window's last backward, before the Trainer clips and
steps. The Trainer steps the optimizer and the LR scheduler after every window, so a skip is
made in its terms (:mod:`fullbatch._base._verdict` has the contract):

- every ``.grad`` is set to ``None``: torch optimizers leave parameters without a gradient, and
  their state, alone, and the Trainer's ``clip_grad_norm_`` finds nothing to clip, so no
  non-finite gradient reaches the optimizer. With a GradScaler (fp16) a non-finite gradient is
  left in place instead: the scaler finds it, skips the optimizer and backs off its scale, and
  Accelerate then leaves the scheduler alone;
- the LR scheduler's state and the learning rates are kept (``trainer._fb_schedule``) and put
  back by :class:`KeepSchedule` after the Trainer's scheduler step (``on_step_end``).

The trainer holds ``fb_counters`` (:class:`WindowCounters`: ``steps`` counts optimizer steps,
``skipped_windows`` the skips; ``trainer.state.global_step`` counts both) and ``_fb_schedule``
as plain attributes, so ``fullbatch.hf.check_trainer``, which restores them, leaves no trace.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import TrainerCallback

from fullbatch._base._normalize import scale_grads
from fullbatch._base._schedule import KeptSchedule
from fullbatch._base._verdict import (
    NONFINITE_GRADIENT,
    Verdict,
    WindowCounters,
    WindowTotals,
    decide,
)

__all__ = ["THROUGH", "KeepSchedule", "WindowCounters", "end_trainer_window"]

# The frameworks between the user's trainer.train() and a Trainer wing's window end.
THROUGH = ("transformers", "accelerate", "trl", "torch")


def end_trainer_window(trainer: Any, model: torch.nn.Module, totals: WindowTotals) -> Verdict:
    """Decide the window, then normalize its gradients, or skip it the Trainer's way."""
    verdict = decide(totals)
    counters: WindowCounters = trainer.fb_counters
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not verdict.skipped:
        scale_grads(grads, verdict.factor)  # the Trainer clips afterwards
        counters.stepped()
        return verdict
    scaler = getattr(trainer.accelerator, "scaler", None)
    if scaler is None or verdict.reason != NONFINITE_GRADIENT:
        for p in model.parameters():
            p.grad = None
    optimizer = trainer.optimizer
    trainer._fb_schedule = KeptSchedule(
        [trainer.lr_scheduler], [] if optimizer is None else optimizer.param_groups
    )
    counters.skipped(
        counters.windows,
        str(verdict.reason),
        report="trainer.fb_counters.skipped_windows",
        scaler=scaler is not None,
        through=THROUGH,
    )
    return verdict


class KeepSchedule(TrainerCallback):
    """Put the LR schedule back after the Trainer's scheduler step that followed a skip."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        kept, self.trainer._fb_schedule = self.trainer._fb_schedule, None
        if kept is not None:
            kept.restore()

"""The end of a window inside a ``transformers.Trainer``, through the one window-close.

``ExactTrainer`` (and so ``ExactSFTTrainer``, ``ExactDPOTrainer``) and ``ExactGRPOTrainer``
call :func:`end_trainer_window` after the window's last backward, before the Trainer clips and
steps; under DeepSpeed, where the engine steps inside the last backward,
:func:`end_deepspeed_window` after it. Both close through
:func:`fullbatch._base._close.close_window`. The Trainer steps the optimizer and the LR
scheduler after every window, so a skip is made in its terms
(:func:`fullbatch._base._close.skip_framework_step`): every ``.grad`` set to ``None`` (with a
GradScaler and a non-finite gradient, left for the scaler, which skips and backs off), and the
LR schedule kept in ``trainer._fb_schedule``, put back by :class:`KeepSchedule` after the
Trainer's scheduler step (``on_step_end``). Under DeepSpeed the engine skips a non-finite
window itself (its overflow check; the scale up front made a skipped window's gradient
non-finite), schedule included.

The trainer holds ``fb_counters`` (:class:`WindowCounters`) and ``_fb_schedule`` as plain
attributes, so ``fullbatch.hf.check_trainer``, which restores them, leaves no trace.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import TrainerCallback

from fullbatch._base._close import Wing, close_window, skip_framework_step
from fullbatch._base._verdict import NONFINITE_GRADIENT, Verdict, WindowCounters, WindowTotals

__all__ = [
    "THROUGH",
    "KeepSchedule",
    "WindowCounters",
    "end_deepspeed_window",
    "end_trainer_window",
]

# The frameworks between the user's trainer.train() and a Trainer wing's window end.
THROUGH = ("transformers", "accelerate", "trl", "torch", "deepspeed")
REPORT = "trainer.fb_counters.skipped_windows"


def _wing(trainer: Any) -> Wing:
    scaler = getattr(trainer.accelerator, "scaler", None) is not None
    return Wing(trainer.fb_counters, REPORT, THROUGH, scaler=scaler)


def end_trainer_window(trainer: Any, model: torch.nn.Module, totals: WindowTotals) -> Verdict:
    """Decide the window, then normalize its gradients (the Trainer clips afterwards), or skip
    it the Trainer's way."""
    wing = _wing(trainer)
    params = list(model.parameters())

    def skip(verdict: Verdict) -> None:
        optimizer = trainer.optimizer
        trainer._fb_schedule = skip_framework_step(
            params,
            [trainer.lr_scheduler],
            [] if optimizer is None else optimizer.param_groups,
            keep_grads=wing.scaler and verdict.reason == NONFINITE_GRADIENT,
        )

    grads = [p.grad for p in params if p.grad is not None]
    return close_window(totals, wing, grads, skip)


def end_deepspeed_window(trainer: Any, engine: Any, loss: float, count: float) -> Verdict:
    """Close a window the DeepSpeed engine has just stepped or skipped: the gradient was the
    window's share already (the scale up front), the norm is DeepSpeed's (before its clip)."""
    norm = engine.get_global_grad_norm()
    totals = WindowTotals(
        loss=loss / count if count > 0 else 0.0,
        count=count,
        squared_norm=float("inf") if norm is None else float(norm) ** 2,
        share=True,
    )
    verdict = close_window(totals, _wing(trainer))
    if verdict.skipped == bool(engine.was_step_applied()):
        raise RuntimeError(
            f"DeepSpeed {'applied' if verdict.skipped else 'skipped'} a step that fullbatch's "
            f"verdict {'skips' if verdict.skipped else 'takes'} ({verdict.reason}); please "
            "report this with your DeepSpeed config."
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

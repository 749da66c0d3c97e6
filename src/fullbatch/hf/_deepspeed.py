"""A Trainer wing's window under the Hugging Face Trainer's DeepSpeed integration.

With a DeepSpeed config the prepared model is a DeepSpeed engine: ZeRO 2/3 reduce and
partition each gradient during backward, so no factor can be applied after the window.
:class:`DeepSpeedTrainerWindow` counts the window when the Trainer reads it (each
micro-batch's items from ``trainer.exact_count``, summed over the ranks), backpropagates
``loss_sum · W / N`` through the engine itself (``scale_wrt_gas=False``: DeepSpeed's ``1 / GA``
off, its average over ``W`` ranks undone; the boundary set on every micro-batch, as
Accelerate's backward sets it) and closes through
:func:`fullbatch._wings._deepspeed.close_engine_window`: ``engine.step()`` at ZeRO 1-3, where a
non-finite loss's NaN scale makes DeepSpeed skip; at stage 0 the gradients are read before the
step and a skipped window is cleared instead. A window without items (on every rank: the count
is global) backpropagates nothing and does not step. The Trainer's own ``optimizer.step()`` is
a no-op (Accelerate's wrapper); with a torch optimizer the LR scheduler is the Trainer's, which
skips its step only after DeepSpeed's overflow skip (``optimizer_step_was_skipped``), so for a
window skipped otherwise (stage 0, no items) the schedule is kept and put back
(:func:`fullbatch.hf._window.keep_schedule`): parameters, optimizer state and LR schedule stay
as they were.

:func:`check_config` refuses, before training, what cannot be exact: a clip that differs from
``max_grad_norm`` (a config without ``gradient_clipping`` clips at DeepSpeed's default: 1.0
since DeepSpeed #8068, 0 before) and what
:func:`fullbatch._wings._deepspeed.refusal` names.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from fullbatch._base._normalize import check_count
from fullbatch._base._verdict import Verdict
from fullbatch._wings._deepspeed import (
    close_engine_window,
    installed_version,
    refusal,
    scaled,
    window_scale,
)
from fullbatch.hf._window import TrainerWindow, keep_schedule, summed, wing

__all__ = [
    "DeepSpeedTrainerWindow",
    "check_config",
    "default_clip",
    "ds_config",
    "engine_of",
    "zero_stage",
]


def _enabled(value: Any, auto: bool) -> bool:
    return bool(auto) if value == "auto" else bool(value)


def ds_config(args: Any) -> dict[str, Any]:
    """The DeepSpeed config the ``TrainingArguments`` hold (``"auto"`` values filled)."""
    config = getattr(getattr(args, "hf_deepspeed_config", None), "config", None)
    return config if isinstance(config, dict) else {}


def zero_stage(args: Any) -> int:
    return int((ds_config(args).get("zero_optimization") or {}).get("stage", 0))


def default_clip() -> float:
    """DeepSpeed's ``gradient_clipping`` for a config without the key: 0 (off) until DeepSpeed
    #8068, 1.0 since (0.17.0: 0; 0.19.8: 1.0). Read from the installed deepspeed, which the
    Trainer is about to run."""
    constants = importlib.import_module("deepspeed.runtime.constants")
    return float(constants.GRADIENT_CLIPPING_DEFAULT)


def check_config(name: str, args: Any) -> None:
    """Raise ``ValueError`` for a DeepSpeed config ``name`` cannot make exact."""
    config = ds_config(args)
    zero = config.get("zero_optimization", {}) or {}
    stage = zero_stage(args)
    offload = str((zero.get("offload_optimizer") or {}).get("device", "none")) in ("cpu", "nvme")
    half = _enabled((config.get("fp16") or {}).get("enabled"), args.fp16) or _enabled(
        (config.get("bf16") or {}).get("enabled"), args.bf16
    )
    clip = config.get("gradient_clipping", default_clip())
    why = refusal(
        stage=stage,
        offload=offload,
        micro_batches=args.gradient_accumulation_steps,
        version=installed_version(),
        half=half,
    )
    if why is None and clip != "auto" and float(clip) != float(args.max_grad_norm or 0.0):
        why = (
            f"the DeepSpeed config clips at gradient_clipping={clip}"
            f"{' (its default: the key is absent)' if 'gradient_clipping' not in config else ''}"
            f' while max_grad_norm={args.max_grad_norm}; set "gradient_clipping": "auto" '
            "in the config (it then follows max_grad_norm)"
        )
    if why is not None:
        raise ValueError(f"{name} cannot make this DeepSpeed step exact: {why}.")


def engine_of(trainer: Any) -> Any:
    """The DeepSpeed engine Accelerate prepared for ``trainer``."""
    return trainer.accelerator.deepspeed_engine_wrapped.engine


class DeepSpeedTrainerWindow(TrainerWindow):
    """A window whose scale ``W / N`` is fixed when the Trainer reads it."""

    def __init__(self, trainer: Any, batches: list[Any]) -> None:
        super().__init__(trainer, batches)
        self.counted = [float(check_count(trainer.exact_count(b))) for b in batches]
        world = trainer.accelerator.num_processes
        self.count, self.c = window_scale(self.counted, summed(trainer), world, trainer.args.device)

    def backward(
        self, trainer: Any, model: torch.nn.Module, loss_sum: torch.Tensor
    ) -> Verdict | None:
        last = self.done == self.size
        if last:  # the one host sync before DeepSpeed steps
            got = torch.stack(self._stats)[:, 1].tolist()
            if got != self.counted:
                raise ValueError(
                    f"{type(trainer).__name__} under DeepSpeed scales each loss by the window's "
                    f"count read before the forward (exact_count: {self.counted}), but the "
                    f"losses held {got} items. Override exact_count(inputs) to count exactly "
                    "the items exact_loss sums."
                )
        engine = engine_of(trainer)
        # No items on any rank: nothing is backpropagated (an all-ignored loss has an exactly
        # zero gradient, which a NaN scale cannot poison) and the engine does not step.
        if self.count > 0:
            engine.set_gradient_accumulation_boundary(last)
            engine.backward(scaled(loss_sum, self.c), scale_wrt_gas=False)
        if not last:
            return None
        verdict, values = close_engine_window(
            engine,
            wing(trainer),
            self.local_totals(),
            summed(trainer),
            count=self.count,
            loss_divisor=self.count,
            ran=self.count > 0,
            skip=lambda _: keep_schedule(trainer, []),  # the Trainer steps its scheduler
        )
        trainer._window_end(values)
        return verdict

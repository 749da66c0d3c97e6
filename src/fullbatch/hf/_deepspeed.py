"""The Trainer wings under a DeepSpeed config (``TrainingArguments(deepspeed=...)``).

:class:`DeepSpeedTrainerWindow` counts the window when the Trainer reads it
(``trainer.exact_count`` per micro-batch, summed over the ranks), backpropagates
``loss_sum · W / N`` through the engine and closes through
:func:`fullbatch._wings._deepspeed.close_engine_window`; a window skipped otherwise than by
DeepSpeed's overflow check keeps the LR schedule (the Trainer steps its scheduler anyway).
:func:`check_config` refuses, before training, a clip that differs from ``max_grad_norm`` and
what :func:`fullbatch._wings._deepspeed.refusal` names. See docs/integrations.md
("DeepSpeed").
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from fullbatch._base._normalize import check_count
from fullbatch._base._schedule import KeptSchedule
from fullbatch._wings._deepspeed import (
    close_engine_window,
    installed_version,
    refusal,
    scaled,
    window_scale,
)
from fullbatch._wings._window import WingWindow
from fullbatch.hf._window import Ended, TrainerWindow, keep_schedule, summed, wing

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

    def __init__(self, trainer: Any, batches: list[Any], loss_scale: float = 1.0) -> None:
        super().__init__(trainer, batches, loss_scale)
        counted = [float(check_count(trainer.exact_count(b))) for b in batches]
        world = trainer.accelerator.num_processes
        self.count, scale = window_scale(counted, summed(trainer), world, trainer.args.device)
        self.numbers = WingWindow(scale, device=trainer.args.device, counted=counted)

    def backward(
        self, trainer: Any, model: torch.nn.Module, loss_sum: torch.Tensor
    ) -> Ended | None:
        last = self.done == self.size
        if last:  # the one host sync before DeepSpeed steps
            self.numbers.check_counted(
                f"{type(trainer).__name__} under DeepSpeed",
                "exact_count",
                "Override exact_count(inputs) to count exactly the items exact_loss sums.",
            )
        engine = engine_of(trainer)
        # No items on any rank: nothing is backpropagated (an all-ignored loss has an exactly
        # zero gradient, which a NaN scale cannot poison) and the engine does not step.
        if self.count > 0:
            engine.set_gradient_accumulation_boundary(last)
            engine.backward(scaled(loss_sum, self.c), scale_wrt_gas=False)
        if not last:
            return None
        kept: list[KeptSchedule] = []
        verdict, values = close_engine_window(
            engine,
            wing(trainer),
            self.numbers,
            summed(trainer),
            count=self.count,
            loss_divisor=self.count,
            ran=self.count > 0,
            # the Trainer steps its scheduler: keep the schedule
            skip=lambda _: kept.append(keep_schedule(trainer, [])),
        )
        return Ended(verdict, values, kept[0] if kept else None)

"""Objects boosted by ColossalAI, and optimizers that are not ``torch.optim.Optimizer``.

ColossalAI's ``Booster.boost(model, optimizer, ...)`` hands back wrappers, recognised here by
class name and module (``colossalai.*``) without importing ColossalAI:

- ``TorchDDPModel`` (``TorchDDPPlugin``): a ``ModelWrapper`` whose ``.module`` is a
  ``DistributedDataParallel``; its forward calls it. fullbatch controls that DDP model's
  gradient sync (the user keeps calling the boosted model). ``TorchAMPModule`` (fp16 autocast)
  and a bare ``ModelWrapper`` are unwrapped the same way.
- ``OptimizerWrapper``: not a ``torch.optim.Optimizer`` (no step hooks); fullbatch hooks, steps
  and clears the optimizer it wraps (``.optim``). ``TorchAMPOptimizer`` too, with its
  GradScaler passed as ``scaler=optimizer.scaler``.
- ZeRO (``LowLevelZeroPlugin``), Gemini, the hybrid-parallel plugins and ``TorchFSDPPlugin``
  (FSDP1) keep, shard or reduce gradients outside the parameters' ``.grad`` themselves:
  refused, with the plugin that works.

Unwrapping the model only changes what fullbatch synchronizes; passing the inner DDP model and
the inner optimizer by hand is the same.

A DeepSpeed engine (``deepspeed.initialize``, or Accelerate's DeepSpeed plugin, whose
``prepare`` returns the engine and a ``DeepSpeedOptimizerWrapper``) is refused the same way:
it reduces and partitions gradients inside its own backward and steps inside
``accelerator.backward``; ``fullbatch.deepspeed.ExactEngine`` is the route that works on it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["check_optimizer", "unwrap_boosted"]

# ColossalAI wrappers whose forward calls `.module` and that leave gradients in `.grad`.
_PASS_THROUGH_MODELS = ("ModelWrapper", "TorchDDPModel", "TorchAMPModule")
# Wrappers that own the gradients: what each does, for the refusal.
_OWN_GRADIENTS = {
    "LowLevelZero": "ZeRO (LowLevelZeroPlugin) moves gradients into its own sharded buckets",
    "Gemini": "Gemini keeps gradients in its own chunks",
    "HybridParallel": "the hybrid-parallel plugins reduce and shard gradients themselves",
    "TorchFSDP": "TorchFSDPPlugin is FSDP1, whose flat gradients fullbatch does not handle",
    "FSDPOptimizer": "TorchFSDPPlugin is FSDP1, whose flat gradients fullbatch does not handle",
    "Moe": "the MoE hybrid-parallel plugin reduces and shards gradients itself",
}
_FIX = (
    "Boost with TorchDDPPlugin (fb.Accumulator on the boosted model and optimizer is then "
    "exact), or train without the Booster: DDP or FSDP2 fully_shard with fb.Accumulator."
)


def _colossal(obj: Any) -> str | None:
    """The ColossalAI class name of ``obj``: its class's, or its nearest ColossalAI base's (a
    user's subclass of ``ModelWrapper`` is a ``ModelWrapper``); None outside ColossalAI."""
    for cls in type(obj).__mro__:
        if cls.__module__.split(".")[0] == "colossalai":
            return cls.__name__
    return None


def _refuse(what: str, name: str, obj: Any) -> None:
    why = next((v for k, v in _OWN_GRADIENTS.items() if name.startswith(k)), None)
    why = why or "it is not a wrapper fullbatch knows to leave the gradients in .grad"
    raise ValueError(
        f"the {what} is ColossalAI's {name} ({type(obj).__module__}.{type(obj).__name__}): "
        f"{why}, so fullbatch cannot normalize and step them. {_FIX}"
    )


_DEEPSPEED_FIX = (
    "so fb.Accumulator cannot normalize them after the window. Use "
    "fullbatch.deepspeed.ExactEngine on the engine instead: `exact = ExactEngine(model, "
    "count=lambda micro: fb.count_tokens(micro['labels']))`, then `for window in "
    "exact.windows(loader)`, `window.backward(loss_sum, n)` and `window.step()` "
    "(docs/distributed.md, 'DeepSpeed')."
)


def _refuse_deepspeed(model: Any, optimizer: Any) -> None:
    """A DeepSpeed engine, or Accelerate's wrapper of its optimizer, is not fullbatch's."""
    engine = any(c.__module__.split(".")[0] == "deepspeed" for c in type(model).__mro__)
    wrapper = type(optimizer).__name__ == "DeepSpeedOptimizerWrapper"
    if engine or wrapper:
        what = (
            f"model is a DeepSpeed engine ({type(model).__name__})"
            if engine
            else ("optimizer is Accelerate's DeepSpeedOptimizerWrapper (its DeepSpeed plugin)")
        )
        raise ValueError(
            f"the {what}: DeepSpeed divides every loss by gradient_accumulation_steps, "
            "reduces (ZeRO 2/3: and partitions) the gradients inside its own backward and "
            f"steps inside accelerator.backward, {_DEEPSPEED_FIX}"
        )


def unwrap_boosted(model: nn.Module, optimizer: Any, scaler: Any) -> tuple[nn.Module, Any]:
    """The model whose gradient sync fullbatch controls and the optimizer it hooks and steps.

    Plain objects (and Accelerate's, unwrapped later) pass through.

    Raises:
        ValueError: a ColossalAI plugin that keeps gradients outside ``.grad`` (ZeRO, Gemini,
            hybrid parallel, FSDP1), or ``TorchAMPOptimizer`` without its GradScaler; a
            DeepSpeed engine.
    """
    _refuse_deepspeed(model, optimizer)
    while (name := _colossal(model)) is not None:
        if name not in _PASS_THROUGH_MODELS:
            _refuse("model", name, model)
        model = model.module  # type: ignore[assignment]  # a Module: the wrapped model
    if (name := _colossal(optimizer)) is not None:
        if name == "TorchAMPOptimizer" and scaler is not optimizer.scaler:
            raise ValueError(
                "the optimizer is ColossalAI's TorchAMPOptimizer (mixed_precision='fp16'), "
                "which scales the loss in its own backward(); fullbatch scales it instead with "
                "that GradScaler: pass scaler=optimizer.scaler."
            )
        if name not in ("OptimizerWrapper", "TorchAMPOptimizer"):
            _refuse("optimizer", name, optimizer)
        optimizer = optimizer.optim
    return model, optimizer


def check_optimizer(optimizer: Any) -> None:
    """Raise ``ValueError`` for an optimizer that is not a ``torch.optim.Optimizer``, naming
    the torch optimizer it wraps when it has one (``.optim``, ``.optimizer``).

    >>> check_optimizer(object())
    Traceback (most recent call last):
      ...
    ValueError: optimizer is builtins.object, not a torch.optim.Optimizer: ...
    """
    if isinstance(optimizer, torch.optim.Optimizer):
        return
    inner = next(
        (
            name
            for name in ("optim", "optimizer")
            if isinstance(getattr(optimizer, name, None), torch.optim.Optimizer)
        ),
        None,
    )
    fix = (
        f"Pass the torch optimizer it wraps: fb.Accumulator(model, optimizer.{inner}, ...)."
        if inner
        else "Pass one (a framework's wrapper usually holds it as .optim or .optimizer)."
    )
    cls = type(optimizer)
    raise ValueError(
        f"optimizer is {cls.__module__}.{cls.__qualname__}, not a torch.optim.Optimizer: "
        f"fullbatch hooks, steps and clears a torch optimizer itself. {fix}"
    )

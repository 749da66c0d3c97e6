"""The declared objective on a recorded call: each micro-batch's ``(loss_sum, count)``.

The objective's rule is :mod:`fullbatch._proof._objective` (shared with ``fb.verify`` and the
wings); this module finds what it needs around a :class:`~fullbatch._probe._capture.Call`. The
built-in objectives run the model on the inputs it received, without the arguments that only
shape its own loss (``labels``, ``num_items_in_batch``, TRL's ``fused_lm_head``), and take the
labels from the call, the engine's micro-batch or beside the input. A call through TRL's fused
LM head (``fused_lm_head=True``: no logits) is replayed through that head, whose per-token
log-probabilities are the same objective. ``None`` infers the objective from a Hugging Face
head's class.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from fullbatch._probe._capture import Call
from fullbatch._proof._objective import (
    check_loss_output,
    infer_objective,
    logits_of,
    objective_loss,
)

__all__ = ["LOSS_ONLY", "ObjectiveFailed", "ObjectiveFn", "describe", "on_output", "resolve"]

ObjectiveFn = Callable[[nn.Module, Call], tuple[torch.Tensor, float]]
#: Keyword arguments that only shape the model's own loss; the objective computes its own.
LOSS_ONLY = ("labels", "shift_labels", "num_items_in_batch", "fused_lm_head", "return_loss")
_HERE = os.path.dirname(os.path.abspath(__file__))


def _no_labels(call: Call) -> ValueError:
    keys = sorted(call.kwargs) if call.kwargs else [f"{len(call.args)} positional"]
    return ValueError(
        f"the built-in objective needs labels, but the model received none (inputs: {keys}) "
        "and none were found around its call (a mapping with 'labels' named inputs, batch or "
        "micro, or a tensor named labels or targets beside the model's input); pass "
        "objective=fn(model, micro) -> (loss_sum, count), where micro is what the model "
        "received."
    )


class ObjectiveFailed(ValueError):
    """A callable objective raised: its own error and traceback, and what it received."""


def describe(value: Any) -> str:
    """A short picture of what a callable objective received.

    >>> describe((torch.zeros(4, 8, dtype=torch.long), {"x": torch.zeros(2)}))
    "tuple (Tensor[4, 8] int64, dict {'x': Tensor[2] float32})"
    """
    if isinstance(value, torch.Tensor):
        return f"Tensor{list(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, Mapping):
        inner = ", ".join(f"{k!r}: {describe(v)}" for k, v in list(value.items())[:8])
        return f"{type(value).__name__} {{{inner}{', ...' if len(value) > 8 else ''}}}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(describe(v) for v in value[:8])
        return f"{type(value).__name__} ({inner}{', ...' if len(value) > 8 else ''})"
    return type(value).__name__


def _failed(name: str, call: Call, micro: Any, error: Exception) -> str:
    """The message of :class:`ObjectiveFailed`: what ``name`` received, then its traceback
    (its own frames, not the probe's)."""
    if call.micro is not None:
        source = "the loop's micro-batch (its variable that holds the model's input)"
    elif call.targets is not None:
        source = "(what the model received, the labels found beside it)"
    else:
        source = "what the model received (no micro-batch or labels found around its call)"
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not _ours(f.filename)]
    shown = "".join(traceback.format_list(frames)) + "".join(
        traceback.format_exception_only(type(error), error)
    )
    return (
        f"the objective {name}(model, micro) raised {type(error).__name__}: {error}\n"
        f"it received micro = {describe(micro)}: {source}; docs/probe.md, 'What a callable "
        f"objective receives'.\nTraceback (most recent call last):\n{shown.rstrip()}"
    )


def _ours(filename: str) -> bool:
    return os.path.dirname(os.path.abspath(filename)) == _HERE


def _fused(module: nn.Module, call: Call) -> tuple[torch.Tensor, float]:
    """TRL's fused LM head, called as the trainer called it: ``Σ -log p`` over its targets
    (the same objective; its float32 tiles round as the trainer's did)."""
    kwargs = {k: v for k, v in call.kwargs.items() if k not in ("num_items_in_batch",)}
    out = module(*call.args, **kwargs)
    return -out.log_probs.sum(), float(out.label_mask.sum())


def _builtin(kind: str) -> ObjectiveFn:
    def objective(module: nn.Module, call: Call) -> tuple[torch.Tensor, float]:
        labels, shifted = call.labels()
        if labels is None:
            raise _no_labels(call)
        if kind == "causal_lm" and call.kwargs.get("fused_lm_head") is True:
            return _fused(module, call)
        kwargs = {k: v for k, v in call.kwargs.items() if k not in LOSS_ONLY}
        logits = logits_of(module(*call.args, **kwargs))
        loss_sum, count = objective_loss(kind, logits, labels, shifted=shifted)
        return loss_sum, float(count)

    return objective


def on_output(kind: str, call: Call, output: Any) -> tuple[torch.Tensor, float] | None:
    """A built-in objective's ``(loss_sum, count)`` on the output the model just returned for
    ``call`` (the same logits a replay would compute), or None where it needs a replay: no
    labels, TRL's fused LM head (no logits), no logits in the output."""
    labels, shifted = call.labels()
    if labels is None or call.kwargs.get("fused_lm_head") is True:
        return None
    if isinstance(output, (tuple, list)) and any(k in call.kwargs for k in LOSS_ONLY):
        return None  # (loss, logits, ...): a replay without the labels returns (logits, ...)
    try:
        logits = logits_of(output)
    except ValueError:
        return None
    loss_sum, count = objective_loss(kind, logits, labels, shifted=shifted)
    return loss_sum, float(count)


def resolve(objective: Any, module: nn.Module) -> tuple[str, ObjectiveFn]:
    """``(its name for the report, fn(module, call) -> (loss_sum, count))``.

    Raises:
        ValueError: ``objective=None`` on a model whose objective cannot be inferred.
    """
    if callable(objective):
        name = getattr(objective, "__name__", "fn")
        name = "fn" if name == "<lambda>" else name

        def user(module: nn.Module, call: Call) -> tuple[torch.Tensor, float]:
            micro = call.user_micro()
            try:
                out = objective(module, micro)
            except Exception as error:
                raise ObjectiveFailed(_failed(name, call, micro, error)) from error
            return check_loss_output(out)

        user.paired_rows = getattr(objective, "paired_rows", False)  # type: ignore[attr-defined]
        return name, user
    kind = objective if objective is not None else infer_objective(module)
    return kind, _builtin(kind)

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

from collections.abc import Callable
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

__all__ = ["ObjectiveFn", "resolve"]

ObjectiveFn = Callable[[nn.Module, Call], tuple[torch.Tensor, float]]
#: Keyword arguments that only shape the model's own loss; the objective computes its own.
_LOSS_ONLY = ("labels", "shift_labels", "num_items_in_batch", "fused_lm_head", "return_loss")


def _no_labels(call: Call) -> ValueError:
    keys = sorted(call.kwargs) if call.kwargs else [f"{len(call.args)} positional"]
    return ValueError(
        f"the built-in objective needs labels, but the model received none (inputs: {keys}) "
        "and none were found around its call (a mapping with 'labels' named inputs, batch or "
        "micro, or a tensor named labels or targets beside the model's input); pass "
        "objective=fn(model, micro) -> (loss_sum, count), where micro is what the model "
        "received."
    )


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
        kwargs = {k: v for k, v in call.kwargs.items() if k not in _LOSS_ONLY}
        logits = logits_of(module(*call.args, **kwargs))
        loss_sum, count = objective_loss(kind, logits, labels, shifted=shifted)
        return loss_sum, float(count)

    return objective


def resolve(objective: Any, module: nn.Module) -> tuple[str, ObjectiveFn]:
    """``(its name for the report, fn(module, call) -> (loss_sum, count))``.

    Raises:
        ValueError: ``objective=None`` on a model whose objective cannot be inferred.
    """
    if callable(objective):

        def user(module: nn.Module, call: Call) -> tuple[torch.Tensor, float]:
            return check_loss_output(objective(module, call.user_micro()))

        name = getattr(objective, "__name__", "fn")
        return ("fn" if name == "<lambda>" else name), user
    kind = objective if objective is not None else infer_objective(module)
    return kind, _builtin(kind)

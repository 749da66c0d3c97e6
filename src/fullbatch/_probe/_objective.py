"""The declared objective: what each micro-batch's ``(loss_sum, count)`` is.

``"causal_lm"`` (token mean with the causal shift; pre-shifted ``shift_labels`` are used as they
are), ``"token"`` (token mean, no shift: masked LM, token classification), ``"sample"`` (mean
over rows: one class label per row, or a regression target), or ``fn(model, micro) ->
(loss_sum, count)``. ``None`` infers one of the three from a Hugging Face head's class name.

The built-in objectives run the model on the inputs it received, without the arguments that
only shape its own loss (``labels``, ``num_items_in_batch``, TRL's ``fused_lm_head``), and
compute the summed loss from the logits with :func:`fullbatch.cross_entropy_sum`. A call through
TRL's fused LM head (``fused_lm_head=True``: no logits) is replayed through that head, whose
per-token log-probabilities are the same objective.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fullbatch._base._losses import cross_entropy_sum
from fullbatch._probe._capture import Call
from fullbatch._verify._arms import check_loss_output
from fullbatch._verify._objective import CHOICES, OBJECTIVES

__all__ = ["OBJECTIVES", "ObjectiveFn", "check_objective", "resolve"]

ObjectiveFn = Callable[[nn.Module, Call], tuple[torch.Tensor, float]]
#: Keyword arguments that only shape the model's own loss; the objective computes its own.
_LOSS_ONLY = ("labels", "shift_labels", "num_items_in_batch", "fused_lm_head", "return_loss")
_HEADS = {
    "causal_lm": ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration"),
    "token": ("ForMaskedLM", "ForTokenClassification"),
    "sample": (
        "ForSequenceClassification",
        "ForImageClassification",
        "ForAudioClassification",
        "ForVideoClassification",
    ),
}


def check_objective(objective: Any) -> None:
    """ValueError unless ``objective`` is None, a known name or a callable.

    >>> check_objective("causal_lm")
    >>> check_objective("mean")
    Traceback (most recent call last):
    ...
    ValueError: objective='mean' is not known; pass objective='causal_lm' ...
    """
    if objective is None or callable(objective) or objective in OBJECTIVES:
        return
    raise ValueError(f"objective={objective!r} is not known; pass {CHOICES}.")


def infer(module: nn.Module) -> str:
    """The objective of a Hugging Face head, from its class name.

    >>> infer(nn.Linear(1, 1))
    Traceback (most recent call last):
    ...
    ValueError: objective=None: the objective of Linear cannot be inferred ...
    """
    name = type(module).__name__
    config = getattr(module, "config", None)
    if not getattr(config, "is_encoder_decoder", False):
        for kind, suffixes in _HEADS.items():
            if name.endswith(suffixes):
                return kind
    raise ValueError(
        f"objective=None: the objective of {name} cannot be inferred (it is not a Hugging Face "
        f"causal-LM, masked-LM or classification head); pass {CHOICES}."
    )


def _logits(outputs: Any) -> torch.Tensor:
    if isinstance(outputs, torch.Tensor):
        return outputs
    logits = (
        outputs.get("logits") if isinstance(outputs, dict) else getattr(outputs, "logits", None)
    )
    if logits is None and isinstance(outputs, (tuple, list)) and outputs:
        logits = outputs[0]
    if not isinstance(logits, torch.Tensor):
        raise ValueError(
            f"the model's outputs ({type(outputs).__name__}) carry no logits for the built-in "
            f"objective; pass objective=fn(model, micro) -> (loss_sum, count)."
        )
    return logits


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
        logits = _logits(module(*call.args, **kwargs))
        if kind == "sample" and labels.is_floating_point():  # regression: squared error
            diff = logits.reshape(labels.shape[0], -1) - labels.reshape(labels.shape[0], -1)
            return diff.pow(2).sum(), float(labels.shape[0])
        if kind == "sample" and labels.dim() != 1:
            raise ValueError(
                f"objective='sample' needs one label per row, got labels of shape "
                f"{tuple(labels.shape)}; token labels: objective='token' or 'causal_lm'."
            )
        shift = kind == "causal_lm" and not shifted
        loss_sum, count = cross_entropy_sum(logits, labels.to(logits.device), shift=shift)
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
    kind = objective if objective is not None else infer(module)
    return kind, _builtin(kind)

"""The declared objective: one vocabulary for ``fb.verify``, ``fb.probe`` and the wings.

An *objective* says what a window's loss is, as ``Σ loss_sum / Σ count`` over its micro-batches
(and ranks); each micro-batch contributes its summed loss and its item count:

- ``"causal_lm"``: next-token cross-entropy over labels that are not ``-100`` after the causal
  shift (pre-shifted ``shift_labels`` are used as they are);
- ``"token"``: cross-entropy per token, no shift (masked LM, token classification);
- ``"sample"``: one label per row: cross-entropy for an integer label, squared error summed
  over the row's outputs for a float target (regression); rows whose label is ``-100`` do not
  count;
- ``fn(model, micro) -> (loss_sum, count)``: the user's own (``fb.verify``, ``fb.probe``;
  ``fullbatch.hf.ExactTrainer`` takes ``fn(outputs, labels)`` as it runs the forward itself).

This module holds that rule once: :func:`objective_loss` (``(loss_sum, count)`` from logits
and labels), :func:`objective_count` (the count alone, from the labels), :func:`logits_of` (the
logits in a model's output), :func:`infer_objective` (a Hugging Face head's objective from its
class name, looking through a known wrapper: :func:`unwrapped`) and :func:`check_loss_output`
(what a callable objective returned).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from fullbatch._base._losses import count_tokens, cross_entropy_sum

__all__ = [
    "CHOICES",
    "HEADS",
    "OBJECTIVES",
    "RENAMED",
    "WRAPPERS",
    "canonical",
    "check_loss_output",
    "check_objective",
    "head_objective",
    "infer_objective",
    "logits_of",
    "objective_count",
    "objective_loss",
    "unwrapped",
]

OBJECTIVES = ("causal_lm", "token", "sample")
CHOICES = (
    "objective='causal_lm' (next-token), 'token' (masked LM, token classification), "
    "'sample' (one label per row) or objective=fn(model, micro) -> (loss_sum, count)"
)
#: A Hugging Face head's objective, by the end of its class name (transformers' ``loss_type``
#: names are among these).
HEADS: dict[str, tuple[str, ...]] = {
    "causal_lm": ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration"),
    "token": ("ForMaskedLM", "ForTokenClassification"),
    "sample": (
        "ForSequenceClassification",
        "ForImageClassification",
        "ForAudioClassification",
        "ForVideoClassification",
    ),
}


#: Objective names of earlier releases and the names they are now (docs/probe.md, "Renamed
#: names"): still accepted for at least one release, with a DeprecationWarning naming the new.
RENAMED = {"masked_lm": "token", "classification": "sample"}


def canonical(objective: Any, arg: str = "objective") -> Any:
    """``objective`` under its current name: an earlier release's spelling (:data:`RENAMED`)
    is accepted with a ``DeprecationWarning`` naming the new one; anything else is returned as
    it is. ``arg`` names the argument in the warning (``"objective"``, ``"loss"``,
    ``"--objective"``).

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as said:
    ...     warnings.simplefilter("always")
    ...     canonical("masked_lm"), canonical("causal_lm")
    ('token', 'causal_lm')
    >>> print(str(said[0].message).split(";")[0])
    objective='masked_lm' is deprecated: it is now objective='token' (same loss, same count)
    """
    if not isinstance(objective, str) or objective not in RENAMED:
        return objective
    new = RENAMED[objective]
    old_text, new_text = (
        (f"{arg} {objective}", f"{arg} {new}")
        if arg.startswith("--")
        else (f"{arg}={objective!r}", f"{arg}={new!r}")
    )
    warnings.warn(
        f"{old_text} is deprecated: it is now {new_text} (same loss, same count); the old "
        "name will be removed in a later release",
        DeprecationWarning,
        stacklevel=3,
    )
    return new


def check_objective(objective: Any) -> Any:
    """``objective`` under its current name (:func:`canonical`); ValueError unless it is None,
    a known name or a callable.

    >>> check_objective("causal_lm")
    'causal_lm'
    >>> check_objective("mean")
    Traceback (most recent call last):
    ...
    ValueError: objective='mean' is not known; pass objective='causal_lm' ...
    """
    objective = canonical(objective)
    if objective is None or callable(objective) or objective in OBJECTIVES:
        return objective
    raise ValueError(f"objective={objective!r} is not known; pass {CHOICES}.")


def head_objective(name: str | None) -> str | None:
    """The objective of a head whose class (or ``loss_type``) is ``name``; None when unknown.

    >>> head_objective("BertForMaskedLM"), head_objective("Linear")
    ('token', None)
    """
    for kind, suffixes in HEADS.items():
        if name and name.endswith(suffixes):
            return kind
    return None


#: Wrappers around a Hugging Face model, by package and class: the attribute that holds it.
#: Composer's ``HuggingFaceModel`` (a ComposerModel) keeps the transformers model as ``.model``.
WRAPPERS: dict[tuple[str, str], str] = {("composer", "HuggingFaceModel"): "model"}


def unwrapped(module: nn.Module) -> nn.Module:
    """The Hugging Face model inside a known wrapper (:data:`WRAPPERS`), else ``module``.

    >>> unwrapped(nn.Linear(1, 1))
    Linear(in_features=1, out_features=1, bias=True)
    """
    cls = type(module)
    attribute = WRAPPERS.get((cls.__module__.split(".")[0], cls.__name__))
    inner = getattr(module, attribute, None) if attribute else None
    return inner if isinstance(inner, nn.Module) else module


def infer_objective(module: nn.Module) -> str:
    """The objective of a Hugging Face head, from its class name (not an encoder-decoder),
    looking through a known wrapper (Composer's ``HuggingFaceModel``: its ``.model``).

    >>> infer_objective(nn.Linear(1, 1))
    Traceback (most recent call last):
    ...
    ValueError: objective=None: the objective of Linear cannot be inferred ...
    """
    module = unwrapped(module)
    name = type(module).__name__
    kind = head_objective(name)
    if kind is not None and not getattr(getattr(module, "config", None), "is_encoder_decoder", 0):
        return kind
    raise ValueError(
        f"objective=None: the objective of {name} cannot be inferred (it is not a Hugging Face "
        f"causal-LM, masked-LM or classification head); pass {CHOICES}."
    )


def logits_of(outputs: Any, *, fix: str = "pass objective=fn(model, micro) -> (loss_sum, count)"):
    """The logits in a model's output: the tensor itself, ``.logits``, ``["logits"]``, or the
    first element of a tuple; ValueError naming ``fix`` when there are none.

    >>> logits_of({"logits": torch.zeros(1)}).shape
    torch.Size([1])
    """
    if isinstance(outputs, torch.Tensor):
        return outputs
    logits = (
        outputs.get("logits") if isinstance(outputs, dict) else getattr(outputs, "logits", None)
    )
    if logits is None and isinstance(outputs, (tuple, list)) and outputs:
        logits = outputs[0]
    if not isinstance(logits, torch.Tensor):
        raise ValueError(f"the model's outputs ({type(outputs).__name__}) carry no logits; {fix}.")
    return logits


def _check_labels(kind: str, logits: torch.Tensor | None, labels: torch.Tensor, arg: str) -> None:
    if kind == "sample":
        if labels.dim() != 1 and not labels.is_floating_point():
            raise ValueError(
                f"{arg}='sample' needs one label per row (labels [rows]); got labels of shape "
                f"{tuple(labels.shape)}. Token labels: {arg}='token' (no shift) or "
                f"{arg}='causal_lm'."
            )
        if logits is not None and not labels.is_floating_point() and logits.dim() != 2:
            raise ValueError(
                f"{arg}='sample' needs logits [rows, classes]; got {tuple(logits.shape)} for "
                f"labels {tuple(labels.shape)}. Token labels: {arg}='token' or 'causal_lm'."
            )
    elif labels.dim() < 2:
        raise ValueError(
            f"{arg}={kind!r} needs token labels [rows, tokens]; got labels of shape "
            f"{tuple(labels.shape)}. One label per row: {arg}='sample'."
        )


def objective_loss(
    kind: str, logits: torch.Tensor, labels: torch.Tensor, *, shifted: bool = False,
    arg: str = "objective",
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(loss_sum, count)`` of one micro-batch under a built-in objective.

    ``shifted``: the labels are already aligned with the logits (``shift_labels``), so
    ``"causal_lm"`` does not shift them again. ``arg`` names the argument in errors
    (``"objective"``, ``"loss"``).

    Raises:
        ValueError: labels whose shape does not fit ``kind``.

    >>> loss, n = objective_loss("sample", torch.zeros(3, 4), torch.tensor([0, -100, 2]))
    >>> round(loss.item(), 4), n.item()
    (2.7726, 2)
    """
    _check_labels(kind, logits, labels, arg)
    labels = labels.to(logits.device)
    if kind == "sample" and labels.is_floating_point():  # regression: squared error per row
        rows = labels.shape[0]
        diff = logits.reshape(rows, -1) - labels.reshape(rows, -1)
        return diff.pow(2).sum(), torch.tensor(rows)
    return cross_entropy_sum(logits, labels, shift=kind == "causal_lm" and not shifted)


def objective_count(kind: str, labels: torch.Tensor, *, shifted: bool = False) -> float:
    """The items :func:`objective_loss` counts for these labels, without logits.

    >>> objective_count("causal_lm", torch.tensor([[1, 2, 3], [4, 5, -100]]))
    3.0
    >>> objective_count("token", torch.tensor([[1, 2, 3], [4, 5, -100]]))
    5.0
    """
    _check_labels(kind, None, labels, "objective")
    if kind == "sample":
        rows = labels.shape[0]
        return float(rows if labels.is_floating_point() else (labels != -100).sum())
    return float(count_tokens(labels, shift=kind == "causal_lm" and not shifted))


def check_loss_output(out: Any) -> tuple[torch.Tensor, float]:
    """``(loss_sum, count)`` from what a loss function or a callable objective returned, or an
    error naming what it was.

    >>> check_loss_output(torch.tensor(2.0))
    Traceback (most recent call last):
    ...
    TypeError: loss_fn returned a Tensor, expected (loss_sum, count): ...
    """
    if not (isinstance(out, tuple) and len(out) == 2):
        what = f"a tuple of {len(out)}" if isinstance(out, tuple) else f"a {type(out).__name__}"
        raise TypeError(
            f"loss_fn returned {what}, expected (loss_sum, count): the loss summed over the "
            "micro-batch's items (a 0-dim tensor) and how many items, e.g. "
            "`return fb.cross_entropy_sum(model(x), y)`."
        )
    loss, count = out
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"loss_fn returned loss_sum as a {type(loss).__name__}, expected a 0-dim "
            "torch.Tensor with a gradient (the loss summed over items): do not call .item() "
            "or float() on it."
        )
    if loss.dim() != 0:
        raise ValueError(
            f"loss_fn returned a loss of shape {tuple(loss.shape)}: it must be a 0-dim sum "
            "over items (call .sum() with reduction='none', or use reduction='sum')."
        )
    if torch.is_grad_enabled() and not loss.requires_grad:
        raise ValueError(
            "loss_fn returned a loss_sum that does not require grad (computed under "
            "torch.no_grad(), detached, or from frozen parameters only); return the loss "
            "with its graph."
        )
    try:
        return loss, float(count)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(
            f"loss_fn returned count as {type(count).__name__} {count!r}, expected a number "
            "or a 0-dim tensor: how many items loss_sum sums over."
        ) from None

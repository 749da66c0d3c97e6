"""``scale_lr``: the learning rate for a *different* global batch size."""

from __future__ import annotations

import math
from numbers import Real
from typing import Any

__all__ = ["scale_lr"]

_RULES = ("linear", "sqrt")


def _positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{name} must be a positive number, got {value!r}.")
    number = float(value)
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}.")
    return number


def scale_lr(lr: float, from_batch: float, to_batch: float, rule: str = "linear") -> float:
    """The learning rate for global batch ``to_batch``, given one tuned for ``from_batch``.

    Use it when you **change** the global batch size (the number of items, rows or tokens,
    that one optimizer step averages over, all ranks and micro-batches included), e.g. to
    train on 8 GPUs with a recipe tuned on 1 without shrinking the per-step batch:

    - ``"linear"``: ``lr * to_batch / from_batch``, the linear scaling rule for SGD
      (Goyal et al., 2017, "Accurate, Large Minibatch SGD"; pair it with a warmup);
    - ``"sqrt"``: ``lr * sqrt(to_batch / from_batch)``, commonly used for Adam-type
      optimizers, whose update size does not grow with the gradient's scale.

    Do **not** use it to emulate a fixed global batch with accumulation: with fullbatch,
    splitting a batch of B into micro-batches leaves every step equal to the full-batch step
    of B (the loss is normalized by the window's global count, not per micro-batch), so the
    learning rate tuned for B is already right: ``from_batch == to_batch`` and the factor is
    1. A rule of thumb "scale the LR by the accumulation steps" compensates for loops that sum
    per-micro-batch means instead of averaging, which fullbatch never does.

    Args:
        lr: the learning rate tuned for ``from_batch`` (> 0).
        from_batch: the global batch size ``lr`` was tuned for (> 0).
        to_batch: the new global batch size (> 0), in the same unit as ``from_batch``.
        rule: ``"linear"`` or ``"sqrt"``.

    Returns:
        the scaled learning rate, a float.

    Raises:
        ValueError: a non-positive or non-finite ``lr`` or batch size, or an unknown ``rule``.

    Example:
        >>> import fullbatch as fb
        >>> fb.scale_lr(0.1, 256, 1024)  # SGD recipe at 256, trained at 1024
        0.4
        >>> fb.scale_lr(3e-4, 64, 256, rule="sqrt")  # AdamW recipe
        0.0006
        >>> fb.scale_lr(3e-4, 256, 256)  # same global batch, split into micro-batches
        0.0003
    """
    if rule not in _RULES:
        raise ValueError(
            f"rule must be one of {_RULES}, got {rule!r}: 'linear' for SGD (Goyal et al.), "
            "'sqrt' for Adam-type optimizers."
        )
    lr = _positive("lr", lr)
    ratio = _positive("to_batch", to_batch) / _positive("from_batch", from_batch)
    return lr * ratio if rule == "linear" else lr * math.sqrt(ratio)

"""``fb.probe``'s arguments, checked before anything is hooked: how many windows, the optimizer
inside its wrapper, and a declared coupled objective.

Kept apart from :mod:`fullbatch._probe._run` (the context manager and its windows), so each
argument's rule and its error text live in one place, with ``ProbeFinished``, the signal the
command-line run stops the script with.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["DEFAULT_WINDOWS", "ProbeFinished", "check_coupled", "inner_optimizer", "window_limit"]

#: Windows checked by default: a gradient left over by a missing zero_grad() shows in the 2nd.
DEFAULT_WINDOWS = 2


class ProbeFinished(BaseException):
    """Raised out of ``step()`` after the probed windows when the probe was asked to stop the
    run (``fullbatch probe`` without ``--keep-training``); a BaseException so that a script's
    ``except Exception`` does not swallow it."""


def window_limit(windows: Any) -> int | None:
    """How many windows to check: ``windows`` itself, :data:`DEFAULT_WINDOWS` for None, None
    (every window) for ``"all"``.

    >>> window_limit(None), window_limit(3), window_limit("all")
    (2, 3, None)
    """
    if windows is None:
        return DEFAULT_WINDOWS
    if windows == "all":
        return None
    if isinstance(windows, bool) or not isinstance(windows, int) or windows < 1:
        raise ValueError(
            f"windows must be a positive int, None (the first {DEFAULT_WINDOWS}) or 'all' (every "
            f"window until the block ends), got {windows!r}; e.g. windows=2 or windows='all'."
        )
    return windows


def inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside Accelerate's or Lightning's wrapper."""
    for _ in range(4):
        inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            break
        optimizer = inner
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"optimizer must be a torch.optim.Optimizer (or a wrapper holding one), got "
            f"{type(optimizer).__name__}; or leave it out: fb.probe() finds the optimizers that "
            "step inside the block."
        )
    return optimizer


def check_coupled(coupled: Any, objective: Any) -> bool:
    """``coupled`` as a bool: True declares that the callable ``objective`` couples the rows
    of a window (in-batch negatives), so the probe compares the step with it over the whole
    window's rows as one batch (:mod:`fullbatch._probe._whole`).

    >>> check_coupled(False, None), check_coupled(True, lambda model, micro: None)
    (False, True)
    """
    if not isinstance(coupled, bool):
        raise ValueError(f"coupled must be True or False, got {coupled!r}.")
    if coupled and not callable(objective):
        raise ValueError(
            f"coupled=True declares a callable objective that couples rows, got objective="
            f"{objective!r}; pass objective=fn(model, micro) -> (loss_sum, count), the loss "
            "over micro's rows (fullbatch probe: --objective FILE.py:FN --coupled)."
        )
    return coupled

"""GradScaler steps for pipeline windows (:class:`fullbatch.Pipeline`'s ``scaler=``).

The scale is read once when a window opens and multiplies each pipeline micro-batch's loss
(:class:`fullbatch.PipelineLoss`), so the backward through every stage carries it. At
``window.step()`` each stage unscales after the data-parallel sum, before the norm and the clip;
whether any gradient is non-finite is decided from the norm summed over every stage and rank,
so every stage skips together, and each stage's scaler is updated the same way once per window.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["check_scaler", "finish_scaler", "window_scale"]


def check_scaler(scaler: Any) -> Any:
    """The scaler if it is an enabled ``torch.amp.GradScaler``-like object, else ``None``.

    Example:
        >>> import torch
        >>> check_scaler(torch.amp.GradScaler("cpu")) is not None
        True
        >>> check_scaler(torch.amp.GradScaler("cpu", enabled=False)) is None
        True
        >>> window_scale(torch.amp.GradScaler("cpu", init_scale=8.0), torch.device("cpu"))
        8.0
    """
    if scaler is None:
        return None
    missing = [
        name for name in ("get_scale", "unscale_", "step", "update") if not hasattr(scaler, name)
    ]
    if missing:
        raise TypeError(
            f"scaler={scaler!r} has no {', '.join(missing)}: give a torch.amp.GradScaler "
            "(e.g. torch.amp.GradScaler('cuda')), or scaler=None."
        )
    return scaler if scaler.is_enabled() else None


def window_scale(scaler: Any, device: torch.device) -> float:
    """The scale of the window now opening. ``scaler.scale`` of a one on the parameters'
    device: it also creates the scale tensor on stages whose loss it never multiplies
    (torch creates it lazily there, and ``unscale_`` needs it)."""
    return float(scaler.scale(torch.ones((), device=device)))


def finish_scaler(scaler: Any, grad_scale: float, nonfinite: bool) -> None:
    """Update ``scaler`` once for the window, identically on every stage and rank.

    ``nonfinite`` is the job-wide verdict. A stage whose own gradients were finite would
    otherwise grow its scale while another stage backs off; so on a non-finite window every
    scaler backs off from the window's scale and its growth count restarts, as torch's
    ``update()`` does after an overflow.
    """
    if not nonfinite:
        scaler.update()  # every stage found its gradients finite: torch's own update
        return
    scaler.update(grad_scale * scaler.get_backoff_factor())
    state = scaler.state_dict()
    state["_growth_tracker"] = 0
    scaler.load_state_dict(state)

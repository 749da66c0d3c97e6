"""A loss already multiplied by a GradScaler's scale, caught before its backward.

``window.backward(scaler.scale(loss_sum), n)`` is the AMP recipe of a hand loop carried into
fullbatch. Without ``scaler=`` fullbatch never unscales, so every gradient is the scale times
too large (256 or 65536: SGD steps that much too far); with ``scaler=`` given the loss is
scaled twice and unscaled once. Both leave one signature in the loss's autograd graph, within a
few nodes of its root: ``scaler.scale(x)`` is ``x * scaler._scale`` (the very tensor, on the
loss's device), a multiplication whose saved ``other`` is a 0-dim tensor without gradient.

:func:`scaled_by` walks the first :data:`_NODES` nodes of the graph (through ``/ n``,
``.sum()``, views) for such a multiplication. A factor that is the given scaler's scale is
identified by identity; another 0-dim factor is looked up among the objects that hold it
(``gc.get_referrers``, a few milliseconds). A GradScaler recipe shows in every micro-batch, so
:class:`ScaledLossWatch` looks at the Accumulator's first :data:`CHECKS` backward calls and then
drops out of the engine's watch list. A factor of another origin (a weight tensor, a
temperature) passes.
"""

from __future__ import annotations

import gc
from collections import deque
from typing import Any

import torch

from fullbatch._engine._state import WindowState
from fullbatch._engine._watch import Watch

__all__ = ["CHECKS", "LOOKUPS", "ScaledLossWatch", "scaled_by"]

#: Autograd nodes looked at from the loss's root (``scaler.scale(x) / n`` is two deep).
_NODES = 8
#: Factors of unknown origin looked up among their referrers, per Accumulator.
LOOKUPS = 4
#: Backward calls looked at, per Accumulator (the recipe shows in each one).
CHECKS = 2


def _factors(loss: torch.Tensor) -> list[torch.Tensor]:
    """0-dim tensors without gradient that multiply the loss near its root."""
    found = []
    queue = deque([loss.grad_fn])
    seen = 0
    while queue and seen < _NODES:
        node = queue.popleft()
        if node is None:
            continue
        seen += 1
        if type(node).__name__ == "MulBackward0":
            for name in ("_saved_other", "_saved_self"):
                try:
                    value = getattr(node, name, None)
                except RuntimeError:  # freed by an earlier backward
                    value = None
                if isinstance(value, torch.Tensor) and value.numel() == 1:
                    if not value.requires_grad and value.is_floating_point():
                        found.append(value)
        queue.extend(next_node for next_node, _ in node.next_functions)
    return found


def _owner(factor: torch.Tensor) -> Any:
    """The GradScaler whose scale ``factor`` is, or None (its attributes may be held in its
    object or in its ``__dict__``)."""
    for holder in gc.get_referrers(factor):
        if isinstance(holder, dict) and holder.get("_scale") is factor:
            holder = next(
                (o for o in gc.get_referrers(holder) if getattr(o, "__dict__", None) is holder),
                None,
            )
        if isinstance(holder, torch.amp.GradScaler) and holder._scale is factor:
            return holder
    return None


def scaled_by(loss: torch.Tensor, given: Any, lookups: int) -> tuple[Any, int]:
    """``(the GradScaler whose scale multiplies loss, or None; lookups left)``.

    >>> scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    >>> w = torch.ones(2, requires_grad=True)
    >>> scaled_by(scaler.scale(w.sum()) / 4, None, 1)[0] is scaler
    True
    >>> scaled_by(w.sum() * torch.tensor(2.0), None, 1)[0] is None
    True
    """
    for factor in _factors(loss):
        if given is not None and getattr(given, "_scale", None) is factor:
            return given, lookups
        if lookups > 0:
            lookups -= 1
            owner = _owner(factor)
            if owner is not None:
                return owner, lookups
    return None, lookups


class ScaledLossWatch(Watch):
    """Per Accumulator: refuses a scaled loss (see the module docstring) before its backward,
    in the first :data:`CHECKS` backward calls. ``scaler``: the enabled GradScaler given to the
    Accumulator, or None."""

    def __init__(self, scaler: Any) -> None:
        self._given = scaler
        self._lookups = LOOKUPS
        self._left = CHECKS

    def before_backward(self, state: WindowState, loss: torch.Tensor, count: Any) -> bool | None:
        if loss.grad_fn is None:
            return None
        scaler, self._lookups = scaled_by(loss, self._given, self._lookups)
        if scaler is not None:
            raise _error(scaler, scaler is self._given, state.index)
        self._left -= 1
        return self._left <= 0


def _error(scaler: Any, given: bool, window: int) -> ValueError:
    scale = float(scaler.get_scale())
    if given:
        return ValueError(
            f"the loss passed to window.backward in window {window} is already scaled by "
            f"the GradScaler given as scaler= (scaler.scale(loss), scale {scale:g}): "
            "fullbatch scales each backward itself, so this one would be scaled twice and "
            f"unscaled once, {scale:g} times too large. Pass the loss unscaled: "
            "window.backward(loss_sum, n). The window was discarded and nothing was changed."
        )
    return ValueError(
        f"the loss passed to window.backward in window {window} is multiplied by a "
        f"GradScaler's scale (scaler.scale(loss), scale {scale:g}) that the Accumulator was "
        f"not given: nothing would unscale it, so every gradient would be {scale:g} times "
        "too large (SGD steps that much too far). Give the scaler to the Accumulator and pass "
        "the loss unscaled: fb.Accumulator(model, optimizer, ..., scaler=scaler) and "
        "window.backward(loss_sum, n); fullbatch scales each backward, unscales before "
        "clipping and stepping, and updates the scaler (do not call scaler.step or "
        "scaler.update yourself). The window was discarded and nothing was changed."
    )

"""Migration mistakes that train silently wrong, caught before anything changes (issues 18, 26).

Each check looks for a signature that correct code cannot have, and each is one
:class:`~fullbatch._engine._watch.Watch` (the list is :mod:`fullbatch._engine._checks`):

- **scheduler stepped per micro-batch** (no ``scheduler=``, :class:`LearningRateWatch`): the
  learning rate changes *between two backward calls of one window*. Setting the LR for the
  coming step before the first backward or after the last one is fine; a change in between
  means ``scheduler.step()`` runs once per micro-batch, decaying K times too fast.
- **the same loss backpropagated twice** (:class:`SameLossTwice`): the same autograd graph
  (the loss tensor, or a view of it) passed to ``window.backward`` a second time for one
  micro-batch, e.g. again with ``count=0``: its gradient would count twice. A second *term*
  is another graph and passes.
- **share without totals** (:class:`ShareWithoutTotals`, with ``counts=``):
  ``window.backward(share)`` in a window that never read ``window.totals``, so the share
  cannot have been divided by it (warned once).
- **optimizer on some parameters** (:func:`warn_untrained`): model parameters that require
  grad but that the optimizer does not hold never train (warned at construction).

Elsewhere: labels and counts (:mod:`fullbatch._engine._labels`), a DDP forward through
``ddp.module`` (:mod:`fullbatch._engine._route`), the loader and the window size
(:mod:`fullbatch._engine._loader_checks`), leftovers of a hand loop
(:mod:`fullbatch._engine._guards`).

Not checked here, because a loss value has no unit: a mean-reduced loss passed with its count
(``F.cross_entropy(..., reduction="mean")``, n), a count in another unit than the loss's sum,
a share divided by the micro-batch's own count. ``fb.verify`` catches the first and the last.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fullbatch._base._warn import warn
from fullbatch._engine._state import WindowState
from fullbatch._engine._watch import Watch

__all__ = ["LearningRateWatch", "SameLossTwice", "ShareWithoutTotals", "warn_untrained"]


def warn_untrained(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Warn when some of the model's trainable parameters are not in the optimizer.

    >>> import warnings
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     warn_untrained(model, torch.optim.SGD(model[1].parameters(), lr=0.1))
    >>> print(str(caught[0].message).split(":")[0])
    2 of the model's 4 trainable parameters (0.weight, 0.bias) are not in the optimizer
    """
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    left = [n for n, p in named if id(p) not in stepped]
    if not left or len(left) == len(named):  # none, or all: the latter raises elsewhere
        return
    shown = ", ".join(left[:3]) + (", ..." if len(left) > 3 else "")
    warn(
        f"{len(left)} of the model's {len(named)} trainable parameters ({shown}) are not in "
        "the optimizer: they get gradients but never train. Freeze them "
        "(`p.requires_grad_(False)`) if that is the intent, or build the optimizer from "
        "model.parameters()."
    )


#: autograd nodes that only view their input: a view of a loss is the same loss
_VIEWS = frozenset(
    {"ViewBackward0", "ReshapeAliasBackward0", "AliasBackward0", "SqueezeBackward0",
     "SqueezeBackward1", "SqueezeBackward2", "UnsqueezeBackward0", "ExpandBackward0"}
)  # fmt: skip


def _graph(loss: torch.Tensor) -> Any:
    """The autograd node that makes ``loss``, looking through views (None for a leaf)."""
    node = loss.grad_fn
    while node is not None and type(node).__name__ in _VIEWS and node.next_functions:
        node = node.next_functions[0][0]
    return node


class SameLossTwice(Watch):
    """The same loss (its autograd node, through views) passed twice for one micro-batch."""

    def __init__(self) -> None:
        self._graphs: list[Any] = []  # autograd nodes backpropagated for this micro-batch

    def before_backward(self, state: WindowState, loss: torch.Tensor, count: Any) -> None:
        graphs = self._graphs
        if state.current_backwards == 0:
            graphs.clear()  # a new micro-batch
        node = _graph(loss)
        if node is None:
            return
        if graphs and any(node is seen for seen in graphs):
            raise ValueError(
                "the same loss was passed to window.backward twice for this micro-batch "
                f"(window {state.index}): its gradient would count twice. Call "
                "window.backward once per loss term; a second term over the same items "
                "is another tensor, `window.backward(aux_sum, 0)` (with "
                "retain_graph=True on the first call when the terms share a graph). "
                "Nothing was changed."
            )
        self._graphs.append(node)

    def before_step(self, state: WindowState) -> None:
        self._graphs.clear()  # the graphs of the window's last micro-batch go with it

    def close(self) -> None:
        self._graphs.clear()


class LearningRateWatch(Watch):
    """A learning rate that changes between two backward calls of one window (no
    ``scheduler=``: a given scheduler is watched by the loop guard)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._groups = optimizer.param_groups
        self._window: Any = None  # the window the learning rates were taken in
        self._lrs: list[Any] | None = None

    def before_backward(self, state: WindowState, loss: torch.Tensor, count: Any) -> None:
        lrs = [_lr(group.get("lr", 0.0)) for group in self._groups]  # ~0.3 us for one group
        if self._window is not state:
            self._window, self._lrs = state, lrs
            return
        if lrs != self._lrs:
            raise RuntimeError(
                f"the learning rate changed between two backward calls of window "
                f"{state.index} (from {self._lrs} to {lrs}): scheduler.step() once per "
                "micro-batch decays the schedule K times too fast. The window was discarded "
                "and nothing was stepped. Pass scheduler= to the Accumulator (it steps once "
                "per optimizer step) and delete your scheduler.step(), or call it after "
                "window.step()."
            )

    def before_step(self, state: WindowState) -> None:
        self._window = self._lrs = None  # the window ends: hold none of it

    def close(self) -> None:
        self._window = self._lrs = None


def _lr(value: Any) -> Any:
    """A comparable learning rate; a tensor one by identity and version (no host sync)."""
    if isinstance(value, torch.Tensor):
        return (id(value), value._version)
    return float(value)


class ShareWithoutTotals(Watch):
    """``window.backward(share)`` in a window that never read ``window.totals`` (warned once)."""

    def before_backward(self, state: WindowState, loss: torch.Tensor, count: Any) -> bool:
        if count is not None or state.totals_read:
            return False
        warn(
            "window.backward(share) in a window that never read window.totals: the "
            "share must be the loss sum divided by a window.totals entry (e.g. "
            "`window.backward(loss_sum / window.totals['tokens'])`), or each "
            "micro-batch weighs its own sum (docs/mistakes.md). Or pass the summed "
            "loss and its count: window.backward(loss_sum, n).",
        )
        return True

"""``Watch``: one check of the engine, and ``Watches``: the list the window calls, built once.

A check of the user's loop (a leftover ``zero_grad``, a scheduler stepped per micro-batch, a
loss passed twice, labels counted on padding, ...) is one class implementing :class:`Watch`:
it overrides the points it needs, and the window tells every watch of the list at each point:

- ``on_micro_batch(state, micro)``: the window is about to yield ``micro``;
- ``before_backward(state, loss, count)``: ``window.backward(loss, count)`` was called and
  its arguments are valid; nothing has changed yet;
- ``after_backward(state)``: that backward ran;
- ``before_step(state)``: ``window.step()`` is about to normalize and step;
- ``close()``: the Accumulator is closed (remove hooks).

``state`` is the window's :class:`~fullbatch._engine._state.WindowState` (its ``index``,
``yielded``, ``current_padding``, ``current_backwards``, ``totals_read``). A watch refuses
by raising: in ``before_backward`` and ``before_step`` the window is abandoned first
(gradients cleared, nothing stepped), so the error leaves parameters and optimizer state as
they were. A hook returns ``True`` once the watch has nothing left to check (a one-time check
that ran): the list closes it and drops it, so it costs nothing afterwards.

:class:`Watches` keeps, for each point, only the watches that override it: the window's hot
path loops over what really checks something (see ``benchmarks/watch_cost.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from fullbatch._engine._state import WindowState

__all__ = ["Watch", "Watches"]

_POINTS = ("on_micro_batch", "before_backward", "after_backward", "before_step")


class Watch:
    """Base of the engine's checks: every point does nothing until a subclass overrides it.

    >>> class Count(Watch):
    ...     seen = 0
    ...     def on_micro_batch(self, state, micro):
    ...         self.seen += 1
    ...         return self.seen == 2  # done after two micro-batches
    >>> count = Count()
    >>> watches = Watches([count])
    >>> for micro in range(3):
    ...     watches.on_micro_batch(None, micro)
    >>> count.seen, list(watches)
    (2, [])
    """

    def on_micro_batch(self, state: WindowState, micro: Any) -> bool | None:
        return None

    def before_backward(self, state: WindowState, loss: torch.Tensor, count: Any) -> bool | None:
        return None

    def after_backward(self, state: WindowState) -> bool | None:
        return None

    def before_step(self, state: WindowState) -> bool | None:
        return None

    def close(self) -> None:
        return None


class Watches:
    """The Accumulator's watches, in order; per point, those that override it.

    Built once per Accumulator (:func:`fullbatch._engine._checks.engine_watches`). A watch
    whose hook returns ``True`` is closed and dropped from every point.
    """

    def __init__(self, watches: Iterable[Watch]) -> None:
        self._watches = list(watches)
        self._index()

    def _index(self) -> None:
        at = {point: self._overriding(point) for point in _POINTS}
        self._micro_batch = at["on_micro_batch"]
        self._before_backward = at["before_backward"]
        self._after_backward = at["after_backward"]
        self._before_step = at["before_step"]

    def _overriding(self, point: str) -> tuple[Watch, ...]:
        base = getattr(Watch, point)
        return tuple(w for w in self._watches if getattr(type(w), point) is not base)

    def _drop(self, watch: Watch) -> None:
        watch.close()
        self._watches.remove(watch)
        self._index()

    def __iter__(self) -> Iterator[Watch]:
        return iter(list(self._watches))

    def at(self, point: str) -> tuple[Watch, ...]:
        """The watches called at ``point`` (one of the four hook names), in order."""
        return self._overriding(point)

    # The four points. A dropped watch leaves the tuples; a loop already running goes on
    # over the tuple it started with.

    def on_micro_batch(self, state: WindowState, micro: Any) -> None:
        for watch in self._micro_batch:
            if watch.on_micro_batch(state, micro):
                self._drop(watch)

    def before_backward(self, state: WindowState, loss: torch.Tensor, count: Any) -> None:
        for watch in self._before_backward:
            if watch.before_backward(state, loss, count):
                self._drop(watch)

    def after_backward(self, state: WindowState) -> None:
        for watch in self._after_backward:
            if watch.after_backward(state):
                self._drop(watch)

    def before_step(self, state: WindowState) -> None:
        for watch in self._before_step:
            if watch.before_step(state):
                self._drop(watch)

    def close(self) -> None:
        """Close every watch (remove their hooks); the list is empty afterwards."""
        watches, self._watches = self._watches, []
        self._index()
        for watch in watches:
            watch.close()

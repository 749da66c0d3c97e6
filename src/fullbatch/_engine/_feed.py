"""The loader's micro-batches for one window: which ones it holds, padding, the tail.

The loader is consumed lazily. A window normally holds one micro-batch of lookahead (enough
to know which micro-batch is the last, the one whose backward synchronizes); it reads the rest
of the window ahead only when something needs it: ``len(window)``, ``partial_window="drop"``,
``counts=`` and FSDP2's equal micro-batch counts.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["Feed", "Stream"]


class Stream:
    """The loader's iterator, shared by consecutive windows; remembers that it ended.

    >>> stream = Stream([7, 8])
    >>> stream.peek(), stream.next(), stream.next(), stream.next()
    ((True, 7), (True, 7), (True, 8), (False, None))
    """

    def __init__(self, loader: Any) -> None:
        self._it: Iterator[Any] = iter(loader)
        self.ended = False
        self.last: Any = None  # the most recent real item: a padding micro-batch if needed
        self._peeked: tuple[bool, Any] | None = None

    def _read(self) -> tuple[bool, Any]:
        if self.ended:
            return False, None
        try:
            item = next(self._it)
        except StopIteration:
            self.ended = True
            return False, None
        return True, item

    def peek(self) -> tuple[bool, Any]:
        """The next item without taking it: read from the loader now, returned by ``next()``."""
        if self._peeked is None:
            self._peeked = self._read()
        return self._peeked

    @property
    def holds_peeked(self) -> bool:
        """An item was read from the loader by :meth:`peek` and not handed out yet."""
        return self._peeked is not None and self._peeked[0]

    def next(self) -> tuple[bool, Any]:
        if self._peeked is not None:
            (ok, item), self._peeked = self._peeked, None
        else:
            ok, item = self._read()
        if ok:
            self.last = item
        return ok, item


class Feed:
    """The micro-batches of one window: those read ahead, and those still in the loader.

    ``pop()`` returns ``(micro, final, padding)`` and keeps one micro-batch of lookahead so
    that ``final`` is known when a micro-batch is handed out.
    """

    def __init__(self, items: list[Any], stream: Stream | None = None, budget: int = 0) -> None:
        self._items: deque[Any] = deque(items)
        self._stream = stream
        self._budget = budget  # how many more micro-batches this window may take from stream
        self._short = False  # the loader ended before the window had all its micro-batches
        self._padding: deque[Any] = deque()

    def _pull(self) -> bool:
        if self._stream is None or self._budget == 0:
            return False
        ok, item = self._stream.next()
        if ok:
            self._items.append(item)
            self._budget -= 1
        else:
            self._budget = 0
            self._short = True
        return ok

    def lookahead(self) -> None:
        """Read the window's first micro-batch, if it has none read yet."""
        if not self._items:
            self._pull()

    def fill(self) -> None:
        """Read the rest of the window ahead."""
        while self._pull():
            pass

    @property
    def read_all(self) -> bool:
        """Every micro-batch of the window has been read from the loader."""
        return self._stream is None or self._budget == 0

    @property
    def real(self) -> list[Any]:
        """The real micro-batches read ahead and not yet handed out."""
        return list(self._items)

    def remaining(self) -> int:
        self.fill()
        return len(self._items) + len(self._padding)

    @property
    def full(self) -> bool:
        """No micro-batch missing: the loader did not end inside this window."""
        self.fill()
        return not self._short

    def add_padding(self, count: int, make: Callable[[], Any]) -> None:
        for _ in range(count):
            self._padding.append(make())

    def pop(self) -> tuple[Any, bool, bool] | None:
        if not self._items:
            self._pull()
        if self._items:
            micro = self._items.popleft()
            if not self._items:
                self._pull()  # the lookahead: is another micro-batch coming?
            return micro, not self._items and not self._padding, False
        if self._padding:
            return self._padding.popleft(), not self._padding, True
        return None

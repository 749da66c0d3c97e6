"""``AutoSize``: where an ``"auto"`` micro-batch size (or token budget) stands.

A size that halves: it knows how to measure a whole window and how to cut one, keeps the
limit an out-of-memory error set, and re-cuts the current window's loader item when the limit
shrinks. The retry itself (agreement over ranks, re-running the window) is the engine's
(``fullbatch._engine._auto``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fullbatch._base._split import count_rows, split_rows

__all__ = ["AutoSize"]


class AutoSize:
    """Where an "auto" size stands, and the current window's loader item to re-cut.

    Args:
        whole: the size of a whole window (e.g. its row count).
        cut: ``cut(item, size)`` -> micro-batches of at most ``size``.
    """

    def __init__(
        self,
        whole: Callable[[Any], int],
        cut: Callable[[Any, int], list[Any]],
    ) -> None:
        self._whole = whole
        self._cut = cut
        self.limit: int | None = None  # None: whole windows (no OOM seen yet)
        self.size: int | None = None  # what the last window ran with
        self.used = 0  # what the current attempt runs with on this rank (0: no data)
        self._item: Any = None

    @classmethod
    def rows(cls) -> AutoSize:
        return cls(count_rows, split_rows)

    def split(self, item: Any) -> list[Any]:
        """Cut a new window's loader item (``None`` when this rank's loader has ended)."""
        self._item = item
        return self._recut()

    def _recut(self) -> list[Any]:
        if self._item is None:
            self.used = 0
            return []
        whole = self._whole(self._item)
        if whole == 0:
            self.used = 0
            return []
        self.used = whole if self.limit is None else min(self.limit, whole)
        self.size = self.used
        return self._cut(self._item, self.used)

    def shrink(self, limit: int) -> list[Any]:
        """Set the new limit and re-cut the current window's item with it."""
        self.limit = limit
        return self._recut()

    def release(self) -> None:
        self._item = None

"""``Windows``: what ``acc.windows(loader)`` returns, an iterator of windows with a length."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fullbatch._engine._window import Window

__all__ = ["Windows"]


class Windows:
    """What :meth:`Accumulator.windows` returns: an iterator of windows with a length.

    ``len()`` needs ``len(loader)``: with ``micro_batches=K`` it is ``ceil(len(loader) / K)``
    (``floor`` with ``partial_window="drop"``), otherwise one window per loader item. Under
    DDP/FSDP2 it counts this rank's loader; give every rank the same number of items (e.g. a
    ``DistributedSampler``) for it to be the job's number of steps.
    """

    def __init__(
        self, windows: Iterator[Window], loader: Any, *, micro_batches: int | None, drop: bool
    ) -> None:
        self._windows = windows
        self._loader = loader
        self._micro_batches = micro_batches
        self._drop = drop

    def __iter__(self) -> Windows:
        return self

    def __next__(self) -> Window:
        return next(self._windows)

    def __len__(self) -> int:
        try:
            items = len(self._loader)
        except TypeError:
            raise TypeError(
                f"len(acc.windows(loader)) needs a loader with a length; a "
                f"{type(self._loader).__name__} has none (a generator or an iterable dataset). "
                "Count the windows yourself from the number of items, or iterate without len()."
            ) from None
        k = self._micro_batches
        if k is None:
            return items
        return items // k if self._drop else -(-items // k)

"""The loader against the window size: what it yields, told from its first items (issue 26).

- **uncollated micro-batch**: with ``micro_batches=K`` a loader item that is a list of per-row
  dicts or tuples is handed to the loop as it is (warned once, looked for in the first
  window).
- **loader and window size that disagree**: with ``micro_batches=K`` a sized loader of fewer
  than K items (one partial window: whole batches given as micro-batches?); with
  ``micro_batch_size=M`` a ``DataLoader(batch_size=B)`` with ``B <= M``, or loader items of
  exactly M rows, one micro-batch per window (a loader of micro-batches: nothing accumulates),
  looked for in the first two windows. Warned once.

The loader's own facts are read when ``acc.windows(loader)`` is called
(:meth:`LoaderChecks.loader`); the items, as the first windows yield them (a
:class:`~fullbatch._engine._watch.Watch`, dropped once they are seen).
"""

from __future__ import annotations

from collections.abc import Sized
from typing import Any

import torch

from fullbatch._base._split import _is_row_list, count_rows
from fullbatch._base._warn import warn
from fullbatch._engine._state import WindowState
from fullbatch._engine._watch import Watch

__all__ = ["LoaderChecks", "loader_mistakes"]

#: windows whose split is compared with micro_batch_size (a loader of micro-batches)
_SIZE_CHECKS = 2


def loader_mistakes(
    loader: Any, *, micro_batches: int | None, micro_batch_size: int | None
) -> dict[str, str]:
    """What the loader's own facts say against the window size: ``{kind: message}``.

    >>> loader_mistakes([1, 2], micro_batches=4, micro_batch_size=None)["items"].split(":")[0]
    'the loader has 2 item(s) but micro_batches=4'
    """
    found = {}
    length = len(loader) if isinstance(loader, Sized) else None
    if micro_batches is not None and length is not None and 0 < length < micro_batches:
        found["items"] = (
            f"the loader has {length} item(s) but micro_batches={micro_batches}: each loader "
            "item is one micro-batch, so the whole loader is a single partial window. If "
            "each loader item is a whole batch (a window), give micro_batch_size=M instead: "
            "fb.Accumulator(..., micro_batch_size=M) splits every item into micro-batches of "
            "M rows."
        )
    size = getattr(loader, "batch_size", None)
    if (
        micro_batch_size is not None
        and isinstance(loader, torch.utils.data.DataLoader)
        and isinstance(size, int)
        and size <= micro_batch_size
    ):
        found["size"] = _no_accumulation(f"the DataLoader's batch_size={size}", micro_batch_size)
    return found


def _no_accumulation(what: str, size: int) -> str:
    return (
        f"{what} is not larger than micro_batch_size={size}: every loader item becomes a "
        "window of one micro-batch, so nothing is accumulated (one optimizer step per loader "
        "item). If the loader yields micro-batches, give micro_batches=K instead (K of them "
        f"make a window): fb.Accumulator(..., micro_batches=K); micro_batch_size={size} "
        "splits each loader item, a whole window, into micro-batches of that many rows."
    )


class LoaderChecks(Watch):
    """The loader's facts when ``acc.windows(loader)`` is called; its items in the first windows.

    >>> checks = LoaderChecks(micro_batch_size=None)
    >>> checks.loader([1, 2, 3], micro_batches=2)  # 3 items: at least one whole window
    """

    def __init__(self, *, micro_batch_size: int | None) -> None:
        self._size = micro_batch_size
        self._size_checks = _SIZE_CHECKS if micro_batch_size is not None else 0
        self._single = 0  # windows of one micro-batch of exactly micro_batch_size rows
        self._loader_items: int | None = None
        self._windows = 0  # windows begun (the first one's micro-batches are looked at)
        self._warned: set[str] = set()

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warn(message)

    def loader(self, loader: Any, *, micro_batches: int | None, resuming: bool = False) -> None:
        """``acc.windows(loader)`` was called: check the loader against the window size.

        ``resuming``: a state is loaded, so the loader holds what is left of the run (it may
        rightly be shorter than one window); its length says nothing about its items.
        """
        self._loader_items = len(loader) if isinstance(loader, Sized) else None
        found = loader_mistakes(loader, micro_batches=micro_batches, micro_batch_size=self._size)
        if resuming:
            found.pop("items", None)
        for key, message in found.items():
            self._warn_once(key, message)

    def on_micro_batch(self, state: WindowState, micro: Any) -> bool:
        if state.yielded == 1:
            self._windows += 1
        if self._windows <= 1 and "rows" not in self._warned and _is_row_list(micro):
            self._warn_once(
                "rows",
                f"a micro-batch is a list of {len(micro)} per-row records, handed to your loop "
                "as it is (with micro_batches=K each loader item is one micro-batch). Collate "
                "rows in the loader (a DataLoader with batch_size= and a collate_fn that pads, "
                "e.g. DataCollatorWithPadding), or pass whole windows with micro_batch_size=, "
                "which collates rows of equal length.",
            )
        if self._size_checks > 0 and state.yielded == 1:
            self._check_size(state, micro)
        return self._windows > 1 and self._size_checks == 0

    def _check_size(self, state: WindowState, micro: Any) -> None:
        """A window of one micro-batch of exactly micro_batch_size rows: micro-batches given?"""
        self._size_checks -= 1
        if state.current_padding or state.yielded + state.feed.remaining() != 1:
            return
        try:
            rows = count_rows(micro)
        except ValueError:
            return
        if rows != self._size:
            return
        self._single += 1
        more = self._loader_items is None or self._loader_items >= 2
        if more and (self._single >= 2 or self._loader_items is not None):
            assert self._size is not None
            self._warn_once("size", _no_accumulation(f"a loader item of {rows} rows", self._size))

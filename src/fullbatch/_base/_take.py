"""Taking a micro-batch's rows from a window item on the device, without waiting for it.

The window's row order is copied to each device once (not once per tensor and micro-batch,
each copy a host synchronization on a GPU), and whether the columns trimmed away held only
padding is read once for the whole window.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fullbatch._base._widths import pad_columns

__all__ = ["RowOrder", "check_cut", "taker"]


def check_cut(cuts: list[tuple[str, torch.Tensor]]) -> None:
    """Refuse a trimmed tensor that held more than padding where it was cut (one read)."""
    if not cuts:
        return
    device = cuts[0][1].device
    held = torch.stack([ok.to(device) for _, ok in cuts]).tolist()
    bad = next((name for (name, _), ok in zip(cuts, held, strict=True) if not ok), None)
    if bad is not None:
        raise ValueError(
            f"item[{bad!r}] holds values other than padding after the rows' lengths, so "
            "trimming it to the longest row would cut them: it is not aligned with the "
            "lengths (a decoder's labels, an end-of-sequence label on the first padding "
            "position?). Pad it like the lengths, or name the keys to trim: "
            "fb.Accumulator(..., token_keys=(...))."
        )


class RowOrder:
    """A window's row order on each device its tensors live on, copied there once."""

    def __init__(self, order: torch.Tensor) -> None:
        self._on: dict[torch.device, torch.Tensor] = {order.device: order}
        self._host = order

    def on(self, device: torch.device) -> torch.Tensor:
        if device not in self._on:
            # The host does not wait for the device queue: the order is a fresh host tensor.
            self._on[device] = self._host.to(device, non_blocking=True)
        return self._on[device]


def taker(
    placed: RowOrder,
    idx: slice,
    rows: int,
    width: int,
    keep: int,
    trim: set[int],
    check: dict[int, str],
    cuts: list[tuple[str, torch.Tensor]],
    pads: dict[int, tuple[float | None, Any]] | None = None,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Rows ``idx`` (of the window's order) of a rows-first tensor; those in ``trim`` cut to
    ``keep`` positions, or, when ``keep`` is wider than the window, padded to it with their
    ``pads`` entry (``(fill, source)``, see :func:`fullbatch._base._widths.pad_columns`).

    A tensor in ``check`` must hold one value (its padding) in the columns cut away: whether
    it does is appended to ``cuts`` (see :func:`check_cut`).
    """

    def take(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0 or t.shape[0] != rows:
            return t  # count_rows already refused other mismatches
        i = placed.on(t.device)[idx]
        if id(t) in trim and keep < width:
            if id(t) in check:  # read once for the whole window (check_cut)
                cut = t[i, keep:]
                cuts.append((check[id(t)], (cut == cut[:1, :1]).all()))
            return t[i, :keep]
        if id(t) in trim and keep > width:
            assert pads is not None
            fill, source = pads[id(t)]
            return pad_columns(t[i], keep - width, fill, source)
        return t[i]

    return take

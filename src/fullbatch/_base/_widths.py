"""``pad_to_multiple_of``: micro-batch widths on a grid, padded with each key's own padding.

A GPU pays for every new micro-batch shape (an attention plan, a compiled graph, a CUDA
graph); trimming each micro-batch to its own longest row makes almost every shape new. With
``pad_to_multiple_of=m`` a trimmed micro-batch's width is its longest row rounded up to a
multiple of ``m`` (a packed row's length likewise), so widths repeat. Exact: the columns added
are padding, which the count and a causal model's real positions never see.

Where the rounded width is wider than the window, the micro-batch is padded past it with each
key's padding: ``labels`` ``-100``; the lengths mask, ``attention_mask`` and the loss masks
(``loss_mask``, ``completion_mask``, ``assistant_masks``) 0; every other per-token key the
window's own padding value, read on the device at the last position of a row shorter than the
window (no host read). A window whose every row fills its width has no padding to copy: its
micro-batches keep the window's width.

With a token budget a width is never rounded past the budget when the longest row fits in it
(the budget is the width then). Row counts: rows x width stays within the budget, so a full
micro-batch's rows are ``budget // width``, one count per width; only a window's last
micro-batch takes the rows left. No rule more: a power-of-two row count for that last one
would halve the distinct shapes again but cost up to 40% more micro-batches per window for the
whole run (``benchmarks/shapes.py`` measures both; docs/concepts.md has the table).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ZERO_PADDED", "Widths", "pad_columns"]

#: per-token keys whose padding is 0 whatever the window holds (masks)
ZERO_PADDED = frozenset({"attention_mask", "loss_mask", "completion_mask", "assistant_masks"})
IGNORE = -100


class Widths:
    """Rounding of micro-batch widths to a multiple (``None``: exact).

    >>> w = Widths(64)
    >>> w.round(1), w.round(64), w.round(65), Widths(None).round(65)
    (64, 64, 128, 65)
    """

    def __init__(self, multiple: int | None) -> None:
        self.multiple = multiple

    def round(self, width: int) -> int:
        """``width`` rounded up to the multiple."""
        m = self.multiple
        return width if m is None else -(-width // m) * m

    def within(self, longest: int, budget: int | None) -> int:
        """``longest`` rounded up, but never past a token ``budget`` that ``longest`` fits in
        (the budget itself is then the width: one more point on the grid).

        >>> Widths(64).within(70, 100), Widths(64).within(70, 128), Widths(64).within(130, 100)
        (100, 128, 192)
        """
        wide = self.round(longest)
        return budget if budget is not None and longest <= budget < wide else wide


def fill_value(name: str | None, lengths_key: str | None) -> float | None:
    """The padding of a key that is the same in every window (None: the window's own)."""
    if name == "labels":
        return IGNORE
    if name is not None and (name in ZERO_PADDED or name == lengths_key):
        return 0
    return None


def pad_columns(
    rows: torch.Tensor, extra: int, fill: float | None, source: torch.Tensor | None
) -> torch.Tensor:
    """``rows`` (rows first, positions second) with ``extra`` more positions of padding:
    ``fill``, or (``fill`` None) ``source``, the window's own padding at one position.

    >>> t = torch.tensor([[5, 6, 0], [7, 0, 0]])
    >>> pad_columns(t, 2, None, t[1:2, 2:3]).tolist(), pad_columns(t, 1, -100, None).tolist()
    ([[5, 6, 0, 0, 0], [7, 0, 0, 0, 0]], [[5, 6, 0, -100], [7, 0, 0, -100]])
    """
    shape = (rows.shape[0], extra, *rows.shape[2:])
    if fill is not None:
        pad = rows.new_full(shape, fill)
    else:
        assert source is not None
        pad = source.to(rows.dtype).expand(shape)
    return torch.cat([rows, pad], dim=1)


def padding_source(t: torch.Tensor, row: int | None, width: int) -> Any:
    """The window's own padding of ``t``: a view of position ``width - 1`` of ``row`` (a row
    shorter than the window), shaped ``[1, 1, ...]``; None when there is no such row."""
    if row is None:
        return None
    return t[row : row + 1, width - 1 : width]

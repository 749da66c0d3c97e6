"""Windows over an in-memory buffer: regroup batches already in memory into windows of rows.

RL post-training samples a *generation batch* once and then trains on it in optimizer windows
that need not line up with it: one generation batch cut into several windows, or one window
spanning several generation batches. :func:`row_windows` turns any stream of in-memory
batches into windows of exactly ``rows`` rows; give them to
``fb.Accumulator(..., micro_batch_size=B)`` (each loader item is a window) and the window's
denominators, named in ``counts=``, are summed over exactly those rows and every rank.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["row_windows"]


def _row_count(batch: Mapping[str, Any]) -> int:
    rows: int | None = None
    first = ""
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            n = value.shape[0]
        elif isinstance(value, (list, tuple)):
            n = len(value)
        else:
            continue
        if rows is None:
            rows, first = n, key
        elif n != rows:
            raise ValueError(
                f"row_windows needs every tensor and list of a batch to have the row count "
                f"first: {first!r} has {rows} rows but {key!r} has {n}. Keep per-row data "
                "rows first and put batch-level values in 0-dim tensors or plain numbers."
            )
    if rows is None:
        raise ValueError(
            f"row_windows got a batch with no rows (keys {sorted(batch)}): give dicts of "
            "tensors (rows first) or per-row lists."
        )
    return rows


def _take(batch: Mapping[str, Any], start: int, stop: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if (isinstance(value, torch.Tensor) and value.dim() > 0) or isinstance(
            value, (list, tuple)
        ):
            out[key] = value[start:stop]
        else:
            out[key] = value
    return out


def _join(
    pieces: list[dict[str, Any]], pad: Mapping[str, float], left: Collection[str]
) -> dict[str, Any]:
    if len(pieces) == 1:
        return pieces[0]
    keys = list(pieces[0])
    for piece in pieces[1:]:
        if list(piece) != keys:
            raise ValueError(
                f"row_windows joins batches into one window, but their keys differ: "
                f"{keys} and {list(piece)}. Give every batch the same keys."
            )
    _check_left(pieces, keys, left)
    out: dict[str, Any] = {}
    for key in keys:
        values = [piece[key] for piece in pieces]
        first = values[0]
        if isinstance(first, torch.Tensor) and first.dim() > 0:
            if first.dim() > 1:
                width = max(v.shape[1] for v in values)
                values = [_pad(v, width, pad.get(key, 0), key in left) for v in values]
            out[key] = torch.cat(values)
        elif isinstance(first, (list, tuple)):
            out[key] = [item for v in values for item in v]
        else:
            out[key] = first
    return out


def _left_padded(mask: Any) -> bool:
    """A 0/1 mask whose rows are ``0...01...1`` with padding on the left of some row."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.is_floating_point():
        return False
    if mask.numel() == 0 or not bool(((mask == 0) | (mask == 1)).all()):
        return False
    rising = bool((mask[:, 1:] >= mask[:, :-1]).all())
    return rising and bool((mask[:, 0] == 0).any()) and bool((mask[:, -1] == 1).all())


def _padded_like(value: Any, mask: torch.Tensor) -> bool:
    """``value`` holds one value (the pad id) wherever ``mask`` is 0: padding, not text."""
    if not isinstance(value, torch.Tensor) or value.shape[:2] != mask.shape:
        return False
    pads = value[mask == 0]
    return pads.numel() > 0 and bool((pads == pads[:1]).all())


def _check_left(pieces: list[dict[str, Any]], keys: list[str], left: Collection[str]) -> None:
    """Refuse to pad a left-padded key on the right: its rows would have padding on both sides.

    A key counts as left-padded when it is a ``*mask*`` key whose rows are ``0...01...1`` and
    another key of its shape holds one value (the pad id) wherever it is 0, in some batch; a
    loss mask over a prompt holds 0s over varied prompt tokens and does not count.
    """
    widths = {key: {p[key].shape[1] for p in pieces if _wide(p[key])} for key in keys}
    for mask_key in [k for k in keys if "mask" in k.lower() and len(widths[k]) > 1]:
        needed = {mask_key}
        for piece in pieces:
            mask = piece[mask_key]
            if _left_padded(mask):
                twins = [k for k in keys if k != mask_key and _padded_like(piece[k], mask)]
                if twins:
                    needed |= set(twins)
        if needed == {mask_key} or needed <= set(left):
            continue
        missing = sorted(needed - set(left))
        raise ValueError(
            f"row_windows joins batches of different widths, and {sorted(needed)} are "
            f"left-padded (rows of {mask_key!r} start with 0s), but {missing} would be padded "
            "on the right: the joined rows would have padding on both sides, which shifts "
            "their positions and the prompt away from its completion. Pass "
            f"left={tuple(sorted(needed | set(left)))!r}."
        )


def _wide(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 1


def _pad(value: torch.Tensor, width: int, fill: float, on_left: bool) -> torch.Tensor:
    missing = width - value.shape[1]
    if missing == 0:
        return value
    shape = (value.shape[0], missing, *value.shape[2:])
    filler = torch.full(shape, fill, dtype=value.dtype, device=value.device)
    return torch.cat([filler, value] if on_left else [value, filler], dim=1)


def row_windows(
    batches: Iterable[Mapping[str, Any]],
    rows: int,
    *,
    pad: Mapping[str, float] | None = None,
    left: Collection[str] = (),
) -> Iterator[dict[str, Any]]:
    """Regroup in-memory batches into windows of exactly ``rows`` rows, in order.

    A batch larger than ``rows`` is cut into several windows; a window may take rows from
    several consecutive batches (the window boundary ignores the batches' boundaries); the
    last window holds what remains (fewer rows). Rows are never reordered or dropped.

    Args:
        batches: dicts whose tensors (at least one dimension) and lists have the row count
            first; other values (0-dim tensors, numbers, strings) are batch-level and are
            taken from the batch that holds the window's first row.
        rows: rows per window, >= 1.
        pad: when a window joins batches whose tensors have different widths (dimension 1,
            e.g. completion lengths), the narrower ones are padded with ``pad[key]``
            (default 0) on the right, ...
        left: ... or on the left for these keys (left-padded prompts). A ``*mask*`` key
            whose rows are ``0...01...1`` next to a key holding one pad id where it is 0 is
            left padding: padding it on the right raises (name it, and the keys padded with
            it, here).

    Returns:
        An iterator of dicts, one per window: give it to ``fb.Accumulator(...,
        micro_batch_size=B)`` as the loader.

    Raises:
        ValueError: ``rows`` is not a positive integer; a batch's tensors and lists disagree
            on the row count; joined batches have different keys; a left-padded mask (and
            the keys padded with it) would be padded on the right (not in ``left``).

    >>> import torch
    >>> gen1 = {"ids": torch.tensor([[1, 1], [2, 2], [3, 3]]), "step": 0}
    >>> gen2 = {"ids": torch.tensor([[4, 4, 4], [5, 5, 5], [6, 6, 6]]), "step": 1}
    >>> [w["ids"].tolist() for w in row_windows([gen1, gen2], rows=2)]
    [[[1, 1], [2, 2]], [[3, 3, 0], [4, 4, 4]], [[5, 5, 5], [6, 6, 6]]]
    """
    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 1:
        raise ValueError(f"rows must be a positive integer (rows per window), got {rows!r}.")
    fill = dict(pad or {})
    pending: list[dict[str, Any]] = []
    have = 0
    for batch in batches:
        if not isinstance(batch, Mapping):
            raise ValueError(
                f"row_windows takes dicts of rows-first tensors, got {type(batch).__name__}."
            )
        n = _row_count(batch)
        start = 0
        while start < n:
            take = min(rows - have, n - start)
            pending.append(_take(batch, start, start + take))
            have += take
            start += take
            if have == rows:
                yield _join(pending, fill, left)
                pending, have = [], 0
    if pending:
        yield _join(pending, fill, left)

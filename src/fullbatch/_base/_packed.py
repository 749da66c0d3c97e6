"""Padding-free packing (``micro_batch_tokens=T, pack=True``): a window's rows packed
first-fit-decreasing into micro-batches of at most ``T`` real tokens, each one packed row.

Output format (DESIGN.md, "Contract, part 3"): every per-token tensor (dimension 1 is the
window's padded length) holds the real tokens of its micro-batch's rows, concatenated, shape
``[1, n, ...]``; ``position_ids`` restart at 0 at every row; the first label of every row is
``-100`` under ``labels`` (so a causal shift never predicts across a boundary, and the count is
the padded run's); no ``attention_mask``; ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (int32, the
row boundaries ``[0, l1, l1+l2, ...]``), ``max_length_q`` / ``max_length_k`` (the longest row)
and ``use_cache=False``. A transformers causal LM that supports packed sequences then gives
the exact step from ``model(**{k: v for k, v in micro.items() if k != "labels"})``.

Rows are never split or truncated: a row longer than ``T`` is a micro-batch of its own (warned
once). With ``pad_to_multiple_of=m`` (:mod:`fullbatch._base._widths`) each packed row's length
is rounded up to a multiple of ``m`` by one more packed sequence of padding at its end (its own
``cu_seq_lens`` span, ``position_ids`` from 0, labels ``-100``, the other keys the window's own
padding), never past ``T`` when the packed rows fit in it (the length is then ``T``). A
window whose every row fills its width has no padding to copy: its packed rows are not
rounded. Empty rows (length 0) hold no token and are left out. Per-row tensors (a label per
row) cannot follow their tokens into one packed row and are refused with the fix.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch

from fullbatch._base._sort_trim import TOKEN_KEYS, Lengths, SortTrim
from fullbatch._base._split import collate_rows, count_rows
from fullbatch._base._warn import warn
from fullbatch._base._widths import Widths, fill_value, pad_columns, padding_source

__all__ = ["IGNORE", "RowPacker", "first_fit_decreasing"]

IGNORE = -100
_BUILT = ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def first_fit_decreasing(lengths: list[int], budget: int) -> list[list[int]]:
    """Row indices per bin: rows longest first, each into the first bin it fits.

    A row longer than ``budget`` gets a bin of its own. Rows of length 0 are left out.

    >>> first_fit_decreasing([3, 7, 2, 5, 1], 8)
    [[1, 4], [3, 0], [2]]
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties keep order
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        if n == 0:
            continue
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(budget - n)
    return bins


class RowPacker:
    """Turns one window item into packed micro-batches (one packed row each).

    >>> mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    >>> item = {"input_ids": mask * 7, "attention_mask": mask, "labels": mask * 7}
    >>> micros = RowPacker(micro_batch_tokens=4)(item)
    >>> [m["position_ids"].tolist() for m in micros]
    [[[0, 1, 2, 0]], [[0, 1]]]
    >>> micros[0]["labels"].tolist(), micros[0]["cu_seq_lens_q"].tolist()
    ([[-100, 7, 7, -100]], [0, 3, 4])
    >>> packed = RowPacker(micro_batch_tokens=4, pad_to_multiple_of=4)(item)[1]
    >>> packed["input_ids"].tolist(), packed["labels"].tolist(), packed["cu_seq_lens_q"].tolist()
    ([[7, 7, 0, 0]], [[-100, 7, -100, -100]], [0, 2, 4])
    """

    def __init__(
        self,
        *,
        micro_batch_tokens: int,
        lengths: Lengths = "attention_mask",
        token_keys: Collection[str] | None = None,
        pad_to_multiple_of: int | None = None,
    ) -> None:
        self.micro_batch_tokens = micro_batch_tokens
        self.widths = Widths(pad_to_multiple_of)
        self.lengths = lengths
        self.token_keys = frozenset(TOKEN_KEYS if token_keys is None else token_keys)
        self._reader = SortTrim(micro_batch_tokens=1, lengths=lengths)
        self._warned: set[str] = set()

    def __call__(self, item: Any) -> list[dict[str, Any]]:
        """The packed micro-batches of ``item``; ``[]`` for an item with no real token.

        Raises:
            ValueError: ``item`` is not a dict of tensors, is not right-padded, holds
                per-row tensors or its own ``position_ids``, or its lengths cannot be read.
        """
        item, lengths, width = self._read(item)
        if lengths is None:
            return []
        budget = self.micro_batch_tokens
        rounding = self.widths.multiple is not None and min(lengths) < width
        longest = max(lengths)
        if longest > budget:
            self._warn(
                "long",
                f"a row of {longest} tokens is longer than micro_batch_tokens={budget}: it is "
                "a packed micro-batch of its own (exact, but larger than the budget). Raise "
                "micro_batch_tokens or cut long rows in the loader.",
            )
        bins = first_fit_decreasing(lengths, budget)
        sizes = [[lengths[r] for r in rows] for rows in bins]
        if rounding:  # one more packed sequence, of padding, rounds each packed row up
            for bin_sizes in sizes:
                extra = self.widths.within(sum(bin_sizes), budget) - sum(bin_sizes)
                if extra:
                    bin_sizes.append(extra)
        meta = _BinMeta(sizes, _device_of(item))
        pads = self._pads(item, lengths, width) if rounding else None
        return [
            self._build(item, rows, lengths, meta.of(b), sizes[b], pads)
            for b, rows in enumerate(bins)
        ]

    def cut(self, item: Any, size: int) -> list[dict[str, Any]]:
        """``self(item)`` with another budget (``micro_batch_tokens="auto"``)."""
        saved, self.micro_batch_tokens = self.micro_batch_tokens, size
        try:
            return self(item)
        finally:
            self.micro_batch_tokens = saved

    def window_tokens(self, item: Any) -> int:
        """Real tokens of the whole window (the budget that packs it into one micro-batch)."""
        _, lengths, width = self._read(item)
        if lengths is None:
            return 0
        rounding = self.widths.multiple is not None and min(lengths) < width
        return self.widths.round(sum(lengths)) if rounding else sum(lengths)

    # -- reading and building ------------------------------------------------------------------

    def _read(self, item: Any) -> tuple[Any, list[int] | None, int]:
        item = collate_rows(item)
        if not isinstance(item, Mapping):
            raise ValueError(
                f"pack=True needs each loader item to be a dict of tensors (as a tokenizer or "
                f"collator gives: input_ids, attention_mask, labels), got a "
                f"{type(item).__name__}. Yield a dict, or use pack=False."
            )
        rows = count_rows(item)
        if rows == 0:
            return item, None, 0
        lengths, width, right = self._reader._lengths(item, rows)
        if not right:
            raise ValueError(
                f"pack=True needs right-padded rows, but the window's {self.lengths!r} is not "
                "1...10...0 in every row (left padding?). Pad on the right "
                "(tokenizer.padding_side = 'right'), or use pack=False (sorted rows, exact "
                "with any padding)."
            )
        self._check_keys(item, rows, width)
        out = [int(n) for n in lengths.tolist()]
        return item, (out if any(out) else None), width

    def _check_keys(self, item: Mapping[str, Any], rows: int, width: int) -> None:
        own = self.lengths if isinstance(self.lengths, str) else None
        for key, value in item.items():
            if key in _BUILT:
                raise ValueError(
                    f"pack=True builds {key!r} itself (positions restarting at every row, row "
                    f"boundaries), but the loader item already has one. Remove {key!r} from "
                    "the loader's output."
                )
            if key == own or not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue
            if value.dim() < 2 or value.shape[1] != width:
                raise ValueError(
                    f"pack=True puts a micro-batch's rows into one packed row, so a tensor "
                    f"with one entry per row cannot follow its tokens: item[{key!r}] has shape "
                    f"{tuple(value.shape)} (rows={rows}, padded length={width}). Give it one "
                    "entry per token (shape rows x positions, e.g. a sequence label repeated "
                    "on the row's tokens), or use pack=False (micro_batch_tokens sorts and "
                    "trims rows, which keeps per-row tensors)."
                )
            if key not in self.token_keys:
                declared = tuple(sorted((self.token_keys & set(item)) | {key}))
                raise ValueError(
                    f"pack=True concatenates each row's tokens, but cannot tell whether "
                    f"item[{key!r}] (shape {tuple(value.shape)}) holds one value per token or "
                    f"per row: its dimension 1 equals the window's padded length {width}. If "
                    f"it is per token, name it: fb.Accumulator(..., token_keys={declared!r}); "
                    "a per-row tensor cannot follow its tokens into one packed row (remove it, "
                    "or use pack=False)."
                )

    def _pads(
        self, item: Mapping[str, Any], lengths: list[int], width: int
    ) -> dict[str, tuple[float | None, Any]]:
        """Each per-token key's padding: a fixed value, or the window's own (a view)."""
        row = lengths.index(min(lengths))  # shorter than the window: its last position pads
        own = self.lengths if isinstance(self.lengths, str) else None
        return {
            key: (fill_value(key, own), padding_source(value, row, width))
            for key, value in item.items()
            if isinstance(value, torch.Tensor) and value.dim() >= 2
        }

    def _build(
        self,
        item: Mapping[str, Any],
        rows: list[int],
        lengths: list[int],
        meta: dict[str, torch.Tensor],
        sizes: list[int],
        pads: dict[str, tuple[float | None, Any]] | None,
    ) -> dict[str, Any]:
        """One packed micro-batch: ``rows``' tokens, then the padding sequence when ``sizes``
        (the bin's packed sequences) holds one more than ``rows``."""
        skip = {"attention_mask", self.lengths if isinstance(self.lengths, str) else ""}
        extra = sizes[-1] if len(sizes) > len(rows) else 0
        out: dict[str, Any] = {}
        for key, value in item.items():
            if key in skip:
                continue
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                out[key] = value
                continue
            packed = torch.cat([value[r, : lengths[r]] for r in rows])[None]
            if extra:
                assert pads is not None
                packed = pad_columns(packed, extra, *pads[key])
            if key == "labels":
                packed = packed.clone()
                packed[0, meta["starts"].to(packed.device)] = IGNORE
            out[key] = packed
        out["position_ids"] = meta["position_ids"]
        out["cu_seq_lens_q"] = meta["cu_seq_lens_q"]
        out["cu_seq_lens_k"] = meta["cu_seq_lens_k"]
        out["max_length_q"] = out["max_length_k"] = int(max(sizes))
        out["use_cache"] = False
        return out

    def _warn(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warn(message)


def _device_of(item: Mapping[str, Any]) -> torch.device:
    """Where the packed tensors go: the device of the item's last per-token tensor."""
    device = torch.device("cpu")
    for value in item.values():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            device = value.device
    return device


class _BinMeta:
    """Every packed micro-batch's row starts, positions and boundaries, built on the host for
    the whole window and copied to the device in one transfer (not three per micro-batch).

    >>> meta = _BinMeta([[3, 1], [2]], torch.device("cpu")).of(0)
    >>> meta["position_ids"].tolist(), meta["cu_seq_lens_q"].tolist(), meta["starts"].tolist()
    ([[0, 1, 2, 0]], [0, 3, 4], [0, 3])
    """

    def __init__(self, sizes: list[list[int]], device: torch.device) -> None:
        parts: list[torch.Tensor] = []
        self._spans: list[tuple[int, int, int, int]] = []  # offset, tokens, rows per bin
        offset = 0
        for bin_sizes in sizes:
            n = torch.tensor(bin_sizes)
            ends = n.cumsum(0)
            bounds = torch.cat([torch.zeros(1, dtype=ends.dtype), ends])
            positions = torch.cat([torch.arange(k) for k in bin_sizes])
            parts += [ends - n, positions, bounds, bounds]
            self._spans.append((offset, len(bin_sizes), int(ends[-1]), len(bin_sizes) + 1))
            offset += 3 * len(bin_sizes) + int(ends[-1]) + 2
        flat = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
        # One copy; the host does not wait for the device queue (a fresh host tensor).
        self._flat = flat.to(device, non_blocking=True)

    def of(self, b: int) -> dict[str, torch.Tensor]:
        """Bin ``b``'s tensors: views of the window's one device tensor (bounds as int32)."""
        offset, rows, tokens, width = self._spans[b]
        at = [offset, offset + rows, offset + rows + tokens, offset + rows + tokens + width]
        flat = self._flat
        return {
            "starts": flat[at[0] : at[1]],
            "position_ids": flat[at[1] : at[2]][None],
            "cu_seq_lens_q": flat[at[2] : at[3]].to(torch.int32),
            "cu_seq_lens_k": flat[at[3] : at[3] + width].to(torch.int32),
        }

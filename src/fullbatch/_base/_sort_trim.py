"""Length-aware micro-batches: one loader item (a whole window) sorted by row length, cut by
rows (``sort_rows=True``) or by a token budget (``micro_batch_tokens``), each micro-batch
trimmed to its own longest row.

Why it is exact: the full-batch gradient is a sum over rows, so regrouping a window's rows
changes nothing but rounding; trimming removes only trailing padding columns, which a causal
model with right padding never lets a real position see.

Rules (DESIGN.md, "Contract, part 2"):

- Row lengths come from ``lengths``: a key (default ``"attention_mask"``) whose 2-D tensor's
  nonzero entries per row are the lengths (a 1-D integer tensor under that key is taken as the
  lengths themselves), or ``fn(item) -> 1-D integer tensor``.
- The window's padded length ``L`` is dimension 1 of the 2-D key; with a callable or a 1-D
  key, dimension 1 of the first tensor leaf with two or more dimensions (``input_ids`` in a
  tokenizer's output). Only per-token tensors are trimmed: the lengths key and the known
  token keys (:data:`TOKEN_KEYS`: ``input_ids``, ``labels``, ...), or exactly the keys given
  as ``token_keys``. Another tensor whose dimension 1 is ``L`` could hold one value per
  token or per row (a feature vector as wide as the padding by chance): without
  ``token_keys`` it is refused, naming it, never trimmed on a guess. On the first windows a
  known key that decides what the loss counts (:data:`COUNTED_KEYS`: ``labels`` and the loss
  masks) must hold padding only in its trimmed columns (one value: ``-100``, 0), or it is not
  aligned with the lengths (a decoder's labels, a label on the first padding position?) and is
  refused. Inputs (``input_ids``, ``token_type_ids``, ...) are not checked where a 2-D mask
  gives the lengths: the mask marks their trimmed columns as padding, whatever values a
  collator left there (several pad ids, an end-of-sequence token), so cutting them cannot
  change the loss. With lengths from a callable or a 1-D key no mask defines them, and they are
  checked like the labels. Other tensors with
  the row count first follow their rows whole; 0-dim tensors and non-tensor leaves go
  unchanged to every micro-batch.
- A window whose mask is not right-padded (not ``1...10...0`` in every row: left padding) is
  regrouped but **not trimmed**: the step stays exact, only the speed-up is lost (warned once).
- A row longer than the token budget is a micro-batch of its own (warned once).
- ``pad_to_multiple_of=m`` (:mod:`fullbatch._base._widths`): each trimmed micro-batch's width
  is its longest row rounded up to a multiple of ``m``, padded past the window's width where
  needed with each key's padding; with a token budget, rows x rounded width stays within it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch

from fullbatch._base._split import collate_rows, count_rows
from fullbatch._base._take import RowOrder, check_cut, taker
from fullbatch._base._warn import warn
from fullbatch._base._widths import Widths, fill_value, padding_source

__all__ = ["COUNTED_KEYS", "TOKEN_KEYS", "Lengths", "SortTrim"]

Lengths = str | Callable[[Any], Any]

#: Keys trimmed with the rows' lengths unless ``token_keys`` names the keys itself: one entry
#: per token, as tokenizers, collators and TRL give them.
TOKEN_KEYS = frozenset(
    {
        "input_ids", "attention_mask", "labels", "position_ids", "token_type_ids",
        "special_tokens_mask", "inputs_embeds", "loss_mask", "completion_mask",
        "assistant_masks",
    }
)  # fmt: skip
#: Known token keys that decide what the loss counts: trimming them must cut padding only.
COUNTED_KEYS = frozenset({"labels", "loss_mask", "completion_mask", "assistant_masks"})
#: windows whose trimmed columns are checked to hold padding only (known keys)
_CONTENT_CHECKS = 2


def _named_leaves(batch: Any, name: str | None = None) -> list[tuple[str | None, torch.Tensor]]:
    """Every tensor leaf with the key of the innermost mapping holding it (None: no key)."""
    if isinstance(batch, torch.Tensor):
        return [(name, batch)]
    if isinstance(batch, Mapping):
        return [leaf for k, v in batch.items() for leaf in _named_leaves(v, str(k))]
    if isinstance(batch, (list, tuple)):
        return [leaf for v in batch for leaf in _named_leaves(v, name)]
    return []


def _tensor_leaves(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        return [t for value in batch.values() for t in _tensor_leaves(value)]
    if isinstance(batch, (list, tuple)):
        return [t for value in batch for t in _tensor_leaves(value)]
    return []


def _rebuild(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``batch`` with ``fn`` applied to every tensor leaf; containers keep their type."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        built = {k: _rebuild(v, fn) for k, v in batch.items()}
        try:
            return type(batch)(built)  # type: ignore[call-arg]
        except TypeError:  # a Mapping that cannot be built from a dict
            return built
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # named tuple
        return type(batch)(*(_rebuild(v, fn) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_rebuild(v, fn) for v in batch)
    return batch


class SortTrim:
    """Turns one window item into length-aware micro-batches; warns at most once per kind.

    Exactly one of ``micro_batch_size`` (fixed rows, sorted) and ``micro_batch_tokens`` (a
    budget of ``rows x longest row`` padded tokens) is given.

    >>> import torch
    >>> mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    >>> item = {"input_ids": mask * 7, "attention_mask": mask, "w": torch.tensor([1.0, 2.0, 3.0])}
    >>> micros = SortTrim(micro_batch_tokens=4)(item)
    >>> [tuple(m["input_ids"].shape) for m in micros], [m["w"].tolist() for m in micros]
    ([(1, 4), (2, 2)], [[2.0], [3.0, 1.0]])
    >>> micros = SortTrim(micro_batch_size=2, pad_to_multiple_of=3)(item)
    >>> [m["attention_mask"].tolist() for m in micros]
    [[[1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]], [[1, 0, 0]]]
    """

    def __init__(
        self,
        *,
        micro_batch_size: int | None = None,
        micro_batch_tokens: int | None = None,
        lengths: Lengths = "attention_mask",
        token_keys: Collection[str] | None = None,
        pad_to_multiple_of: int | None = None,
    ) -> None:
        if (micro_batch_size is None) == (micro_batch_tokens is None):
            raise ValueError("SortTrim needs exactly one of micro_batch_size, micro_batch_tokens.")
        self.micro_batch_size = micro_batch_size
        self.micro_batch_tokens = micro_batch_tokens
        self.lengths = lengths
        self.token_keys = None if token_keys is None else frozenset(token_keys)
        self.widths = Widths(pad_to_multiple_of)
        self._content_checks = _CONTENT_CHECKS
        self._warned: set[str] = set()

    def __call__(self, item: Any) -> list[Any]:
        """The micro-batches of ``item``, longest rows first; ``[]`` for an item with 0 rows.

        Raises:
            ValueError: ``item`` cannot be split into rows, or its lengths cannot be read.
        """
        item = collate_rows(item)
        rows = count_rows(item)
        if rows == 0:
            return []
        lengths, width, right_padded = self._lengths(item, rows)
        if not right_padded:
            self._warn(
                "left",
                f"a window's {self.lengths!r} is not right-padded (some row is not 1...10...0, "
                "e.g. left padding): its micro-batches are regrouped but not trimmed, which "
                "keeps the step exact but gives up the speed-up. Pad on the right "
                "(tokenizer.padding_side = 'right') to get it back.",
            )
        trim: set[int] = set()
        check: dict[int, str] = {}
        if right_padded:
            trim, check = self._per_token(item, rows, width)
        if self._content_checks > 0:
            self._content_checks -= 1
        else:
            check = {}
        order = torch.sort(lengths, descending=True, stable=True).indices
        widest = self._widest(lengths, width, right_padded)
        sizes = self._group(lengths[order].tolist(), widest, right_padded)
        pads = self._pads(item, lengths, width, trim) if widest > width else None
        placed = RowOrder(order)  # on each device once, not per micro-batch
        cuts: list[tuple[str, torch.Tensor]] = []
        micros, start = [], 0
        for size in sizes:
            idx = slice(start, start + size)
            keep = self._width(int(lengths[order[start]]), widest) if right_padded else width
            take = taker(placed, idx, rows, width, keep, trim, check, cuts, pads)
            micros.append(_rebuild(item, take))
            start += size
        check_cut(cuts)
        return micros

    def _widest(self, lengths: torch.Tensor, width: int, right_padded: bool) -> int:
        """How wide a micro-batch of this window may be: the window's width, or (rounding
        with padding to copy) its width rounded up. Not trimmed (left padding): the width."""
        if not right_padded or self.widths.multiple is None:
            return width
        shorter = bool((lengths < width).any()) if len(lengths) else False
        return self.widths.round(width) if shorter else width

    def _width(self, longest: int, widest: int) -> int:
        """A micro-batch's width: its longest row (at least 1), rounded (not past the token
        budget when that row fits in it), at most ``widest``."""
        return min(self.widths.within(max(longest, 1), self.micro_batch_tokens), widest)

    def _pads(
        self, item: Any, lengths: torch.Tensor, width: int, trim: set[int]
    ) -> dict[int, tuple[float | None, Any]]:
        """Each trimmed tensor's padding past the window: a fixed value, or its own padding."""
        row = int(torch.argmin(lengths))  # shorter than the window: its last position pads
        own = self.lengths if isinstance(self.lengths, str) else None
        return {
            id(t): (fill_value(name, own), padding_source(t, row, width))
            for name, t in _named_leaves(item)
            if id(t) in trim
        }

    def _per_token(self, item: Any, rows: int, width: int) -> tuple[set[int], dict[int, str]]:
        """Tensors to trim (by id), and those among them whose trimmed columns are checked.

        Raises:
            ValueError: a tensor whose dimension 1 is the padded length under a key that is
                neither known nor declared (``token_keys``): per token or per row?
        """
        own = self.lengths if isinstance(self.lengths, str) else None
        # A 2-D mask marks the trimmed columns as padding for every input: only what the loss
        # counts is checked then (an input's padding may hold several values, harmlessly).
        masked = own is not None and _dims(item, own) == 2
        checked = COUNTED_KEYS if masked else TOKEN_KEYS - {"position_ids"}
        trim: set[int] = set()
        check: dict[int, str] = {}
        for name, t in _named_leaves(item):
            if t.dim() < 2 or t.shape[0] != rows or t.shape[1] != width:
                continue
            if name is not None and (name == own or name in (self.token_keys or TOKEN_KEYS)):
                trim.add(id(t))
                if self.token_keys is None and name != own and name in checked:
                    check[id(t)] = name
            elif self.token_keys is None:
                raise ValueError(_ambiguous(name, t, width, _keys(item)))
        return trim, check

    def cut(self, item: Any, size: int) -> list[Any]:
        """``self(item)`` with another size: rows (``micro_batch_size``) or a token budget."""
        tokens = self.micro_batch_tokens is not None
        saved = self.micro_batch_tokens if tokens else self.micro_batch_size
        if tokens:
            self.micro_batch_tokens = size
        else:
            self.micro_batch_size = size
        try:
            return self(item)
        finally:
            if tokens:
                self.micro_batch_tokens = saved
            else:
                self.micro_batch_size = saved

    def window_tokens(self, item: Any) -> int:
        """Padded tokens of the whole window as one micro-batch (rows x longest row)."""
        item = collate_rows(item)
        rows = count_rows(item)
        if rows == 0:
            return 0
        lengths, width, right_padded = self._lengths(item, rows)
        widest = self._widest(lengths, width, right_padded)
        longest = self._width(int(lengths.max()), widest) if right_padded else width
        return rows * longest

    # -- lengths -------------------------------------------------------------------------------

    def _lengths(self, item: Any, rows: int) -> tuple[torch.Tensor, int, bool]:
        """``(lengths, padded length L, right-padded?)`` of the window's rows."""
        if callable(self.lengths):
            return self._checked(self.lengths(item), item, rows, "the lengths= callable")
        key = self.lengths
        value = item.get(key) if isinstance(item, Mapping) else getattr(item, key, None)
        if not isinstance(value, torch.Tensor):
            got = "absent" if value is None else f"a {type(value).__name__}"
            raise ValueError(
                f"cannot read the rows' lengths: the loader item's {key!r} is {got}. Give "
                f"lengths= a key of the item holding a padding mask (rows x positions, "
                "nonzero on real tokens, right padding), or a callable "
                "lengths=lambda item: <1-D integer tensor of row lengths>."
            )
        if value.dim() == 1:
            return self._checked(value, item, rows, f"item[{key!r}]")
        if value.dim() != 2 or value.shape[0] != rows:
            raise ValueError(
                f"lengths={key!r}: expected a mask of shape (rows={rows}, positions), got shape "
                f"{tuple(value.shape)}. Pass lengths= a callable returning the row lengths."
            )
        real = value != 0
        counts = real.sum(dim=1)
        width = value.shape[1]
        right = (real == (torch.arange(width, device=value.device) < counts[:, None])).all()
        # Lengths and the right-padding check in one read (none for a mask on the host).
        read = torch.cat([counts, right.reshape(1).to(counts.dtype)]).cpu()
        return read[:-1], width, bool(read[-1])

    def _checked(
        self, value: Any, item: Any, rows: int, what: str
    ) -> tuple[torch.Tensor, int, bool]:
        if (
            not isinstance(value, torch.Tensor)
            or value.dim() != 1
            or value.dtype.is_floating_point
            or value.is_complex()
            or value.dtype == torch.bool
            or value.shape[0] != rows
        ):
            shown = (
                f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
                if isinstance(value, torch.Tensor)
                else repr(value)
            )
            raise ValueError(
                f"{what} must give a 1-D integer tensor with one length per row ({rows} rows), "
                f"got {shown}."
            )
        wide = [t for t in _tensor_leaves(item) if t.dim() >= 2 and t.shape[0] == rows]
        if not wide:
            raise ValueError(
                f"{what} gave row lengths, but the loader item has no tensor of shape (rows, "
                "positions, ...) to trim; use micro_batch_size=M without sort_rows instead."
            )
        lengths = value.detach().cpu().long()
        width = wide[0].shape[1]
        if int(lengths.min()) < 0 or int(lengths.max()) > width:
            raise ValueError(
                f"{what} gave lengths from {int(lengths.min())} to {int(lengths.max())}, "
                f"outside 0..{width} (dimension 1 of the item's first tensor with positions)."
            )
        return lengths, width, True

    # -- grouping ------------------------------------------------------------------------------

    def _group(self, sorted_lengths: list[int], widest: int, trimmed: bool) -> list[int]:
        """Row counts of consecutive micro-batches over rows sorted longest first; ``widest``:
        the widest a micro-batch may be (every micro-batch's width when not ``trimmed``)."""
        rows = len(sorted_lengths)
        if self.micro_batch_size is not None:
            m = self.micro_batch_size
            return [min(m, rows - i) for i in range(0, rows, m)]
        budget = self.micro_batch_tokens
        assert budget is not None
        sizes: list[int] = []
        i = 0
        while i < rows:
            longest = sorted_lengths[i]
            wide = self._width(longest, widest) if trimmed else widest
            if wide > budget:
                shown = longest if trimmed else wide
                rounded = "" if wide == max(shown, 1) else f" (rounded up to {wide})"
                self._warn(
                    "long",
                    f"a row of {shown} tokens{rounded} is longer than micro_batch_tokens="
                    f"{budget}: it is a micro-batch of its own (exact, but larger than the "
                    "budget). Raise micro_batch_tokens or cut long rows in the loader.",
                )
            take = min(max(budget // wide, 1), rows - i)
            sizes.append(take)
            i += take
        return sizes

    def _warn(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warn(message)


def _ambiguous(name: str | None, t: torch.Tensor, width: int, keys: set[str]) -> str:
    """The message for a tensor as wide as the padding under a key fullbatch does not know."""
    shown = f"item[{name!r}]" if name is not None else "a tensor without a key"
    head = (
        f"fullbatch trims each micro-batch to its longest row, but cannot tell whether "
        f"{shown} (shape {tuple(t.shape)}) holds one value per token (trim it) or per row "
        f"(keep it whole): its dimension 1 equals the window's padded length {width}."
    )
    if name is None:
        return f"{head} Yield a dict, so that each tensor has a key, and name the per-token keys."
    known = [*sorted(TOKEN_KEYS & keys), name]
    return (
        f"{head} Name the per-token keys: fb.Accumulator(..., token_keys={tuple(known)!r}) "
        f"trims {name!r} with the tokens; leave it out of token_keys and it follows its rows "
        "whole."
    )


def _dims(item: Any, key: str) -> int:
    """Dimensions of the tensor under ``key`` (0 when there is none)."""
    value = item.get(key) if isinstance(item, Mapping) else getattr(item, key, None)
    return value.dim() if isinstance(value, torch.Tensor) else 0


def _keys(item: Any) -> set[str]:
    return set(item) if isinstance(item, Mapping) else set()

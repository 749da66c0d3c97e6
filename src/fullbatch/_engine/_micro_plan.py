"""``MicroBatchPlan``: how a loader item becomes micro-batches, parsed once.

The options ``micro_batches`` / ``micro_batch_size`` / ``micro_batch_tokens`` (an integer or
``"auto"``), ``sort_rows``, ``pad_to_multiple_of``, ``lengths``, ``token_keys``, ``pack``,
``verify_pack``,
``partial_window``, ``padding_micro_batch`` and ``counts`` are checked here, each rule beside
the option it constrains, before anything changes; every bad value is refused with the value
received and the fix. The plan builds the splitter once (:class:`~fullbatch._base._sort_trim.
SortTrim`, :class:`~fullbatch._base._packed.RowPacker` or a plain cut by rows; an
:class:`~fullbatch._base._autosize.AutoSize` for ``"auto"``) and answers what the engine asks:
the current size, whether it is ``"auto"``, the mode and size a checkpoint records, whether the
window is read ahead.

>>> import torch
>>> plan = MicroBatchPlan(micro_batch_size=2)
>>> plan.size_name, plan.size, plan.mode, plan.items_are_windows
('micro_batch_size', 2, 'micro_batch_size', True)
>>> [len(m["x"]) for m in plan.cut({"x": torch.zeros(5, 3)})]
[2, 2, 1]
>>> MicroBatchPlan(micro_batch_size="auto").size is None  # before the first window
True
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from fullbatch._base._autosize import AutoSize
from fullbatch._base._packed import RowPacker
from fullbatch._base._sort_trim import Lengths, SortTrim
from fullbatch._base._split import count_rows, split_rows

__all__ = ["ACCELERATOR_MULTIPLE", "MicroBatchPlan", "PartialWindow", "Size", "on_accelerator"]

Size = int | Literal["auto"]
#: ``pad_to_multiple_of`` when it is None and the model is on a GPU: widths on a grid of 64
#: (docs/concepts.md, "Shapes on a GPU": ~5% more tokens, ~30 shapes instead of ~1,000)
ACCELERATOR_MULTIPLE = 64
PartialWindow = Literal["step", "drop"]
Split = Callable[[Any], list[Any]]


def on_accelerator(model: Any) -> bool:
    """Whether the model's (first) parameter lives on an accelerator (not the CPU, not meta).

    >>> import torch
    >>> on_accelerator(torch.nn.Linear(1, 1)), on_accelerator(torch.nn.Identity())
    (False, False)
    """
    parameters = getattr(model, "parameters", None)
    first = next(iter(parameters()), None) if callable(parameters) else None
    return first is not None and first.device.type not in ("cpu", "meta")


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
    return value


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}.")
    return value


@dataclass(kw_only=True, slots=True, frozen=True)
class MicroBatchPlan:
    """How a loader item becomes micro-batches (see the Accumulator's docstring for each option).

    Raises:
        ValueError: not exactly one of the three sizes, a size that is not an integer >= 1
            (or ``"auto"`` for the last two), a ``pad_to_multiple_of`` that is not an integer
            >= 1, or an option given without the one it works with (``sort_rows`` without
            ``micro_batch_size``, ``lengths`` / ``token_keys`` / ``pad_to_multiple_of``
            without sorting, ``pack`` without ``micro_batch_tokens``, ``partial_window="drop"``
            without ``micro_batches``); a bad ``counts`` or ``padding_micro_batch``.
    """

    micro_batches: int | None = None
    micro_batch_size: Size | None = None
    micro_batch_tokens: Size | None = None
    sort_rows: bool = False
    pad_to_multiple_of: int | None = None
    lengths: Lengths = "attention_mask"
    token_keys: Collection[str] | None = None
    pack: bool = False
    verify_pack: bool = True
    partial_window: PartialWindow = "step"
    padding_micro_batch: Callable[[], Any] | None = None
    counts: Mapping[str, Callable[[Any], Any]] | None = None
    #: the model trains on an accelerator: ``pad_to_multiple_of=None`` means
    #: :data:`ACCELERATOR_MULTIPLE` there (exact widths on a CPU)
    accelerator: bool = False
    #: ``split(item)``: the micro-batches of a loader item, at a fixed size
    split: Split = field(init=False, repr=False, compare=False)
    #: where an ``"auto"`` size stands (it cuts with the size it has found); None: fixed
    auto: AutoSize | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._check_sizes()
        self._check_lengths()
        self._check_token_keys()
        self._check_multiple()
        if _bool("pack", self.pack) and self.micro_batch_tokens is None:
            raise ValueError(
                "pack=True packs each window's rows into micro-batches of at most T real "
                "tokens: give micro_batch_tokens=T (or 'auto') with it, and have the loader "
                f"yield whole windows; got micro_batches={self.micro_batches!r}, "
                f"micro_batch_size={self.micro_batch_size!r}, micro_batch_tokens=None."
            )
        _bool("verify_pack", self.verify_pack)
        counts = self.counts
        if counts is not None:
            if not isinstance(counts, Mapping) or not all(callable(f) for f in counts.values()):
                raise ValueError(
                    f"counts must map names to functions of a micro-batch, got {counts!r}; "
                    "e.g. counts={'tokens': lambda m: fb.count_tokens(m['labels'])}."
                )
            object.__setattr__(self, "counts", dict(counts))
        if self.padding_micro_batch is not None and not callable(self.padding_micro_batch):
            raise ValueError("padding_micro_batch must be a callable returning a micro-batch.")
        split, auto = self._build()
        object.__setattr__(self, "split", split)
        object.__setattr__(self, "auto", auto)

    def _check_sizes(self) -> None:
        given = [self.micro_batches, self.micro_batch_size, self.micro_batch_tokens]
        if sum(v is not None for v in given) != 1:
            raise ValueError(
                "give exactly one of micro_batches=K (the loader yields micro-batches, K per "
                "window), micro_batch_size=M (each loader item is a window, split into rows "
                "of M) or micro_batch_tokens=T (each loader item is a window, cut into "
                "micro-batches of at most T padded tokens); got "
                f"micro_batches={self.micro_batches!r}, "
                f"micro_batch_size={self.micro_batch_size!r}, "
                f"micro_batch_tokens={self.micro_batch_tokens!r}."
            )
        if self.partial_window not in ("step", "drop"):
            raise ValueError(
                f"partial_window must be 'step' or 'drop', got {self.partial_window!r}."
            )
        if self.partial_window == "drop" and self.micro_batches is None:
            raise ValueError(
                "partial_window='drop' works with micro_batches=K only: with micro_batch_size "
                "every loader item is a whole window. Drop short batches in the loader instead "
                "(DataLoader(drop_last=True))."
            )
        if self.micro_batches is not None:
            _positive_int("micro_batches", self.micro_batches)
        elif self.micro_batch_size is not None and self.micro_batch_size != "auto":
            _positive_int("micro_batch_size", self.micro_batch_size)

    def _check_lengths(self) -> None:
        """The length-aware options: they sort (and trim) rows, so they need a split."""
        if _bool("sort_rows", self.sort_rows) and self.micro_batch_size is None:
            raise ValueError(
                "sort_rows=True sorts each window's rows by length before cutting it into "
                "micro_batch_size=M rows; give micro_batch_size=M with it (micro_batch_tokens=T "
                f"always sorts, micro_batches=K never splits); got micro_batch_size=None, "
                f"micro_batch_tokens={self.micro_batch_tokens!r}."
            )
        lengths = self.lengths
        if not (isinstance(lengths, str) or callable(lengths)):
            raise ValueError(
                f"lengths must be a key of the loader item (e.g. 'attention_mask') or a callable "
                f"fn(item) -> 1-D integer tensor of row lengths, got {lengths!r}."
            )
        if lengths != "attention_mask" and not self.sorts:
            raise ValueError(
                f"lengths={lengths!r} is used only to sort and trim rows: give "
                "micro_batch_tokens=T, or micro_batch_size=M with sort_rows=True."
            )
        if self.micro_batch_tokens is not None and self.micro_batch_tokens != "auto":
            _positive_int("micro_batch_tokens", self.micro_batch_tokens)

    def _check_token_keys(self) -> None:
        """``token_keys``: None, or the names of the per-token keys (trimmed or packed)."""
        keys = self.token_keys
        if keys is None:
            return
        if isinstance(keys, str) or not all(isinstance(k, str) for k in keys):
            raise ValueError(
                f"token_keys must be a collection of key names, e.g. ('input_ids', "
                f"'attention_mask', 'labels'), got {keys!r}."
            )
        if not self.sorts:
            raise ValueError(
                f"token_keys={tuple(keys)!r} names the per-token tensors that are trimmed or "
                "packed: give micro_batch_tokens=T, or micro_batch_size=M with sort_rows=True."
            )
        object.__setattr__(self, "token_keys", frozenset(keys))

    def _check_multiple(self) -> None:
        """``pad_to_multiple_of``: an integer >= 1 that rounds the widths of sorted rows; None:
        exact widths on a CPU, :data:`ACCELERATOR_MULTIPLE` on an accelerator (exact below a
        token budget of that size)."""
        m = self.pad_to_multiple_of
        if m is None:
            tokens = self.micro_batch_tokens
            small = isinstance(tokens, int) and tokens < ACCELERATOR_MULTIPLE
            if self.accelerator and self.sorts and not small:
                object.__setattr__(self, "pad_to_multiple_of", ACCELERATOR_MULTIPLE)
            return
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(
                f"pad_to_multiple_of must be an integer >= 1 (micro-batch widths are rounded up "
                f"to a multiple of it, e.g. 64), or None for exact widths; got {m!r}."
            )
        if not self.sorts:
            raise ValueError(
                f"pad_to_multiple_of={m} rounds up the width of micro-batches trimmed to their "
                "longest row: give micro_batch_tokens=T, or micro_batch_size=M with "
                "sort_rows=True. Without them micro-batches keep the loader's width; pad it in "
                f"the collator instead (e.g. DataCollatorWithPadding(tokenizer, "
                f"pad_to_multiple_of={m}))."
            )
        tokens = self.micro_batch_tokens
        if isinstance(tokens, int) and tokens < m:
            raise ValueError(
                f"pad_to_multiple_of={m} is larger than micro_batch_tokens={tokens}: every "
                "micro-batch would be one row over the budget. Give micro_batch_tokens a "
                f"multiple of {m} (e.g. {m * max(tokens // m, 1) * 8}) or a smaller multiple."
            )

    def _build(self) -> tuple[Split, AutoSize | None]:
        """The splitter, and an :class:`AutoSize` when the size is ``"auto"`` (it then cuts,
        with the size it has found). With ``micro_batches=K`` nothing is ever split."""
        tokens, size, keys = self.micro_batch_tokens, self.micro_batch_size, self.token_keys
        lengths, multiple = self.lengths, self.pad_to_multiple_of
        if tokens is not None:
            cutter: SortTrim | RowPacker
            kind = RowPacker if self.pack else SortTrim
            cutter = kind(
                micro_batch_tokens=1, lengths=lengths, token_keys=keys, pad_to_multiple_of=multiple
            )
            if tokens == "auto":
                return cutter, AutoSize(cutter.window_tokens, cutter.cut)
            cutter.micro_batch_tokens = tokens
            return cutter, None
        if self.sort_rows:
            rows = SortTrim(
                micro_batch_size=1, lengths=lengths, token_keys=keys, pad_to_multiple_of=multiple
            )
            if size == "auto":
                return rows, AutoSize(count_rows, rows.cut)
            rows.micro_batch_size = int(size or 1)
            return rows, None
        if size == "auto":
            return _by_rows(1), AutoSize.rows()
        return _by_rows(int(size or 1)), None

    # -- what the engine asks --------------------------------------------------------------

    @property
    def sorts(self) -> bool:
        """Rows are sorted by length (and trimmed, or packed): ``lengths`` is read."""
        return self.micro_batch_tokens is not None or self.sort_rows

    @property
    def items_are_windows(self) -> bool:
        """Each loader item is a whole window (False: a micro-batch, ``micro_batches=K``)."""
        return self.micro_batches is None

    @property
    def is_auto(self) -> bool:
        return self.auto is not None

    @property
    def drop(self) -> bool:
        """``partial_window="drop"``: a short last window is dropped on every rank."""
        return self.partial_window == "drop"

    @property
    def size_name(self) -> str:
        """The public name of the size: ``micro_batches``, ``micro_batch_size`` or
        ``micro_batch_tokens``."""
        if self.micro_batches is not None:
            return "micro_batches"
        return "micro_batch_tokens" if self.micro_batch_tokens is not None else "micro_batch_size"

    @property
    def size(self) -> int | None:
        """The size given, or where ``"auto"`` stands now (None before its first window)."""
        if self.auto is not None:
            return self.auto.size
        value = self.micro_batches or self.micro_batch_size or self.micro_batch_tokens
        return value if isinstance(value, int) else None

    @property
    def fixed_rows(self) -> int | None:
        """``micro_batch_size`` when it is an integer (rows per micro-batch), else None."""
        size = self.micro_batch_size
        return size if isinstance(size, int) else None

    @property
    def mode(self) -> str:
        """How windows are cut, as a checkpoint records it (another mode resumes elsewhere)."""
        m = self.pad_to_multiple_of
        pad = "" if m is None else f", pad_to_multiple_of={m}"
        if self.micro_batches is not None or self.micro_batch_tokens is not None:
            return self.size_name + pad
        return "micro_batch_size" + (", sort_rows" if self.sort_rows else "") + pad

    @property
    def checkpoint_size(self) -> int | str:
        """The size a checkpoint records: the integer given, or ``"auto"``."""
        value = self.micro_batches or self.micro_batch_size or self.micro_batch_tokens
        return value if isinstance(value, int) else "auto"

    @property
    def reads_ahead(self) -> bool:
        """The whole window is read before its first micro-batch (``partial_window="drop"``
        needs to know it is full, ``counts=`` its totals)."""
        return self.drop or self.counts is not None

    @property
    def decides_at_start(self) -> bool:
        """The window-start exchange decides something from every rank's row: a dropped
        tail, ``window.totals``, an ``"auto"`` attempt."""
        return self.reads_ahead or self.is_auto

    @property
    def checks_packing(self) -> bool:
        """``pack=True`` with ``verify_pack``: the first packed window is checked."""
        return self.pack and self.verify_pack

    def cut(self, item: Any, *, ended: bool = False) -> list[Any]:
        """A loader item's micro-batches; ``ended``: this rank's loader has no item left."""
        if self.auto is not None:
            return self.auto.split(None if ended else item)
        return [] if ended else self.split(item)


def _by_rows(size: int) -> Split:
    return lambda item: split_rows(item, size)

"""Splitting one loader item (a whole window) into micro-batches of rows.

Rules (DESIGN.md, "Splitting"): tensors whose first dimension is the row count are split;
non-tensor leaves and 0-dim tensors go unchanged to every micro-batch; any other mismatch
raises ``ValueError`` naming the key. Containers are dicts (any Mapping), lists and tuples
(named tuples keep their type), nested to any depth.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.data import default_collate

__all__ = ["collate_rows", "count_rows", "split_rows", "take_rows"]


def _leaves(batch: Any, path: str = "batch") -> list[tuple[str, torch.Tensor]]:
    if isinstance(batch, torch.Tensor):
        return [(path, batch)]
    if isinstance(batch, Mapping):
        return [leaf for key, value in batch.items() for leaf in _leaves(value, f"{path}[{key!r}]")]
    if isinstance(batch, (list, tuple)):
        return [leaf for i, value in enumerate(batch) for leaf in _leaves(value, f"{path}[{i}]")]
    return []


def _is_row_list(batch: Any) -> bool:
    """A list of per-row records (dicts or tuples), as ``list(dataset)`` gives: not collated."""
    return (
        isinstance(batch, list)
        and len(batch) > 0
        and (
            all(isinstance(row, Mapping) for row in batch)
            or all(isinstance(row, tuple) for row in batch)
        )
    )


def collate_rows(batch: Any) -> Any:
    """Collate a list of per-row records into one batch with rows first; other items as is.

    A list of dicts (or tuples) with 1-D tensors would otherwise be split along its *token*
    axis. Rows of equal shapes are stacked, as a ``DataLoader`` would; rows of different
    lengths need padding, which only the user can choose.

    >>> rows = [{"ids": torch.tensor([1, 2]), "y": 0}, {"ids": torch.tensor([3, 4]), "y": 1}]
    >>> batch = collate_rows(rows)
    >>> batch["ids"].tolist(), batch["y"].tolist()
    ([[1, 2], [3, 4]], [0, 1])

    Raises:
        ValueError: the rows cannot be stacked (different lengths or keys).
    """
    if not _is_row_list(batch):
        return batch
    try:
        return default_collate(batch)
    except (RuntimeError, TypeError, KeyError, ValueError) as error:
        kind = "dicts" if isinstance(batch[0], Mapping) else "tuples"
        raise ValueError(
            f"the loader item is a list of {len(batch)} per-row {kind}, which fullbatch would "
            f"have to stack into one batch, but they do not stack ({error}). Collate rows in "
            "the loader: a DataLoader with a collate_fn that pads them (e.g. transformers' "
            "DataCollatorWithPadding, or torch.nn.utils.rnn.pad_sequence with an "
            "attention_mask) so that every tensor has the row count first."
        ) from error


def count_rows(batch: Any) -> int:
    """The row count shared by every tensor leaf of ``batch`` with at least one dimension.

    Raises:
        ValueError: no such tensor, two tensors disagree (the message names both keys), or
            ``batch`` is a list of per-row records that was not collated.
    """
    if _is_row_list(batch):
        raise ValueError(
            f"the batch is a list of {len(batch)} per-row records, not one batch with rows "
            "first: fullbatch would count the elements of the first row as rows. Collate it "
            "(torch.utils.data.default_collate, or a DataLoader's collate_fn that pads)."
        )
    rows: int | None = None
    first = ""
    for path, tensor in _leaves(batch):
        if tensor.dim() == 0:
            continue
        if rows is None:
            rows, first = tensor.shape[0], path
        elif tensor.shape[0] != rows:
            raise ValueError(
                f"cannot split the loader item into rows: {first} has {rows} rows but {path} "
                f"has shape {tuple(tensor.shape)}. Every tensor with a dimension must have the "
                "row count first; packed sequences (one row with cu_seqlens) cannot be split "
                "by rows: give the loader micro-batches and use micro_batches=K instead."
            )
    if rows is None:
        raise ValueError(
            f"cannot split a loader item of type {type(batch).__name__} into rows: it holds "
            "no tensor with a first dimension. Yield tensors (or dicts/lists/tuples of them) "
            "with the row count first, or use micro_batches=K with a loader of micro-batches."
        )
    return rows


def take_rows(batch: Any, start: int, stop: int) -> Any:
    """Rows ``start:stop`` of every tensor leaf with a dimension (views); other leaves as is.

    >>> take_rows({"x": torch.arange(4), "t": torch.tensor(2.0)}, 1, 3)["x"].tolist()
    [1, 2]
    """
    if isinstance(batch, torch.Tensor):
        return batch if batch.dim() == 0 else batch[start:stop]
    if isinstance(batch, Mapping):
        taken = {k: take_rows(v, start, stop) for k, v in batch.items()}
        try:
            return type(batch)(taken)  # type: ignore[call-arg]
        except TypeError:  # a Mapping that cannot be built from a dict
            return taken
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # named tuple
        return type(batch)(*(take_rows(v, start, stop) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(take_rows(v, start, stop) for v in batch)
    return batch


def split_rows(batch: Any, micro_batch_size: int) -> list[Any]:
    """Split ``batch`` into consecutive micro-batches of ``micro_batch_size`` rows (views).

    The last micro-batch holds the remainder; a size larger than the batch gives one
    micro-batch. An item with zero rows gives an empty list.

    >>> import torch
    >>> [m["x"].tolist() for m in split_rows({"x": torch.arange(5), "t": 1.0}, 2)]
    [[0, 1], [2, 3], [4]]
    """
    batch = collate_rows(batch)
    rows = count_rows(batch)
    return [
        take_rows(batch, i, min(i + micro_batch_size, rows))
        for i in range(0, rows, micro_batch_size)
    ]

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

__all__ = ["count_rows", "split_rows", "take_rows"]


def _leaves(batch: Any, path: str = "batch") -> list[tuple[str, torch.Tensor]]:
    if isinstance(batch, torch.Tensor):
        return [(path, batch)]
    if isinstance(batch, Mapping):
        return [leaf for key, value in batch.items() for leaf in _leaves(value, f"{path}[{key!r}]")]
    if isinstance(batch, (list, tuple)):
        return [leaf for i, value in enumerate(batch) for leaf in _leaves(value, f"{path}[{i}]")]
    return []


def count_rows(batch: Any) -> int:
    """The row count shared by every tensor leaf of ``batch`` with at least one dimension.

    Raises:
        ValueError: no such tensor, or two tensors disagree (the message names both keys).
    """
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
    rows = count_rows(batch)
    return [
        take_rows(batch, i, min(i + micro_batch_size, rows))
        for i in range(0, rows, micro_batch_size)
    ]

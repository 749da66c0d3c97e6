"""The same math with other rounding: a batch with its rows in reverse order.

A full batch (or one micro-batch) with its rows reversed computes the same gradient in exact
arithmetic; how far it moves in floating point is part of the model's own rounding band, which
``fb.verify`` and ``fb.probe`` both measure this way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["reverse_rows"]


def reverse_rows(batch: Any, rows: int) -> Any:
    """``batch`` with its ``rows`` rows in reverse order (tensor leaves with a dimension).

    >>> reverse_rows({"x": torch.arange(3), "n": 2}, 3)
    {'x': tensor([2, 1, 0]), 'n': 2}
    """
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            return batch
        return batch[torch.arange(rows - 1, -1, -1, device=batch.device)]
    if isinstance(batch, Mapping):
        return {k: reverse_rows(v, rows) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # named tuple
        return type(batch)(*(reverse_rows(v, rows) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(reverse_rows(v, rows) for v in batch)
    return batch

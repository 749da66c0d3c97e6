"""Squared norms and distances of gradient lists in float64, a chunk at a time.

Casting a whole tensor to float64 would allocate twice its size (an embedding of a large
vocabulary: gigabytes); chunks of :data:`CHUNK` entries bound the temporaries to a few MiB.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["CHUNK", "norm", "squared"]

CHUNK = 1 << 20

Grads = Sequence[torch.Tensor | None]


def squared(a: Grads, b: Grads | None = None, *, scale: float = 1.0) -> float:
    """``Σ ‖scale·a_i − b_i‖²`` (or ``Σ ‖scale·a_i‖²`` without ``b``), None as zeros, float64.

    >>> squared([torch.tensor([3.0, 4.0])])
    25.0
    >>> squared([torch.tensor([1.0]), None], [torch.tensor([0.5]), torch.tensor([2.0])], scale=2.0)
    6.25
    """
    total = 0.0
    others = b if b is not None else [None] * len(a)
    for x, y in zip(a, others, strict=True):
        if x is None and y is None:
            continue
        flat_x = None if x is None else x.detach().reshape(-1)
        flat_y = None if y is None else y.detach().reshape(-1)
        n = (flat_x if flat_x is not None else flat_y).numel()  # type: ignore[union-attr]
        for start in range(0, n, CHUNK):
            part = torch.zeros(min(CHUNK, n - start), dtype=torch.float64, device=_device(x, y))
            if flat_x is not None:
                part += flat_x[start : start + CHUNK].double() * scale
            if flat_y is not None:
                part -= flat_y[start : start + CHUNK].to(part.device, torch.float64)
            total += float(part.pow(2).sum())
    return total


def _device(x: torch.Tensor | None, y: torch.Tensor | None) -> torch.device:
    return (x if x is not None else y).device  # type: ignore[union-attr]


def norm(a: Grads) -> float:
    """The total 2-norm of a gradient list (None as zeros), float64, a chunk at a time.

    >>> norm([torch.tensor([3.0]), None, torch.tensor([4.0])])
    5.0
    """
    return math.sqrt(squared(a))

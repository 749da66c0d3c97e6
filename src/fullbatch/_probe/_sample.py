"""The gradient coordinates the per-micro-batch fit looks at.

A model with at most :data:`LIMIT` trainable entries is fitted on all of them (the weights are
then exact). A larger one on ``LIMIT`` coordinates drawn once, uniformly, from a generator
seeded the same on every rank (so every rank samples the same coordinates); each micro-batch
then costs ``LIMIT`` float64 numbers, not a gradient.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["LIMIT", "Sampler", "whole_shape"]

#: Coordinates kept per micro-batch (float64: 128 KiB each).
LIMIT = 16384
_SEED = 20240924


def whole_shape(p: torch.Tensor) -> torch.Size:
    """A parameter's whole shape: a ``DTensor``'s is its global one; DeepSpeed ZeRO-3 keeps a
    partitioned parameter's in ``ds_shape`` (its own is empty between its forwards).

    >>> whole_shape(nn.Parameter(torch.zeros(2, 3)))
    torch.Size([2, 3])
    """
    shape = getattr(p, "ds_shape", None)
    return torch.Size(shape) if shape is not None else p.shape


class Sampler:
    """Picks the same coordinates out of any list of gradients for ``params``.

    >>> params = [nn.Parameter(torch.zeros(2, 2)), nn.Parameter(torch.zeros(3))]
    >>> sampler = Sampler(params)
    >>> sampler.take([torch.ones(2, 2), None]).tolist()
    [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    """

    def __init__(self, params: list[nn.Parameter], limit: int = LIMIT) -> None:
        self.params = params
        sizes = [whole_shape(p).numel() for p in params]
        total = sum(sizes)
        self.exact = total <= limit
        self.index: list[torch.Tensor | None] = [None] * len(params)
        if self.exact:
            self.size = total
            return
        generator = torch.Generator().manual_seed(_SEED)
        chosen = torch.randint(total, (limit,), generator=generator).unique()
        starts = torch.tensor([0, *sizes]).cumsum(0)
        owner = torch.searchsorted(starts, chosen, right=True) - 1
        for i, p in enumerate(params):
            mine = chosen[owner == i] - starts[i]
            self.index[i] = mine.to(p.device)
        self.size = int(chosen.numel())

    def take(self, grads: list[torch.Tensor | None]) -> torch.Tensor:
        """The sampled entries of ``grads`` (one per parameter, None as zeros), float64 on CPU."""
        parts = []
        for p, g, index in zip(self.params, grads, self.index, strict=True):
            n = whole_shape(p).numel() if index is None else index.numel()
            if g is None:
                parts.append(torch.zeros(n, dtype=torch.float64))
                continue
            flat = g.detach().reshape(-1)
            picked = flat if index is None else flat[index]
            parts.append(picked.to("cpu", torch.float64))
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)

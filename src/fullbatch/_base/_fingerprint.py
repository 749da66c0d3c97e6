"""Short fingerprints, to tell whether a resumed run stands where its state was saved.

- :func:`fingerprint` of a loader item: structure (mapping keys, sequence lengths, tensor
  dtypes and shapes) and contents (tensor bytes, numbers, strings) go into one BLAKE2b digest.
  A tensor on an accelerator is copied to the host, once.
- :func:`tensor_sums` of a parameter or an optimizer state tensor: two integer reductions
  where the tensor lives, no host copy of its contents.

Both are computed only when a state is saved and when it is resumed, never per micro-batch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["fingerprint", "tensor_sums"]


def fingerprint(item: Any) -> str:
    """16 hex digits that change when ``item``'s structure or contents change.

    >>> a = {"x": torch.arange(4), "y": [1, 2]}
    >>> fingerprint(a) == fingerprint({"x": torch.arange(4), "y": [1, 2]})
    True
    >>> fingerprint(a) == fingerprint({"x": torch.arange(1, 5), "y": [1, 2]})
    False
    """
    digest = hashlib.blake2b(digest_size=8)
    _feed(digest, item)
    return digest.hexdigest()


def _feed(digest: Any, item: Any) -> None:
    if isinstance(item, torch.Tensor):
        t = item.detach()
        digest.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        if t.layout == torch.strided and t.numel():
            flat = t.reshape(-1).contiguous().cpu()
            digest.update(flat.view(torch.uint8).numpy().tobytes())
    elif isinstance(item, Mapping):
        digest.update(f"M{len(item)}".encode())
        for key, value in item.items():
            digest.update(repr(key).encode())
            _feed(digest, value)
    elif isinstance(item, Sequence) and not isinstance(item, str | bytes):
        digest.update(f"S{len(item)}".encode())
        for value in item:
            _feed(digest, value)
    elif isinstance(item, str | bytes | int | float | bool | complex) or item is None:
        digest.update(repr(item).encode())
    else:  # an object without a known structure: its type only
        digest.update(type(item).__qualname__.encode())


# -- tensors that stay where they are: parameters and optimizer state ------------------------

_CHUNK = 1 << 22  # elements summed at a time (a 32 MiB int64 copy at most)
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def tensor_sums(t: torch.Tensor) -> torch.Tensor:
    """``[sum, sum of squares]`` of ``t``'s bit patterns as integers, modulo 2**64 (int64).

    Computed where ``t`` lives (two reductions, in chunks: no host copy, little memory) and
    exact: integer sums modulo 2**64 do not depend on the order of summation, so the result
    is the same on any device and any number of threads. A DTensor is read as its local
    shard. Any change of any element changes it (but for a collision, about 2**-64).

    >>> a = torch.tensor([1.0, -2.0, 0.5])
    >>> torch.equal(tensor_sums(a), tensor_sums(a.clone()))
    True
    >>> torch.equal(tensor_sums(a), tensor_sums(torch.tensor([1.0, -2.0, 0.25])))
    False
    """
    to_local = getattr(t, "to_local", None)
    t = (to_local() if callable(to_local) else t).detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    out = torch.zeros(2, dtype=torch.int64, device=t.device)
    if t.numel() == 0:
        return out
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    if t.is_floating_point():
        t = t.view(_INTS[t.element_size()])
    for chunk in t.reshape(-1).split(_CHUNK):
        bits = chunk.to(torch.int64)
        out[0] += bits.sum()
        out[1] += (bits * bits).sum()
    return out

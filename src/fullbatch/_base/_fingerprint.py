"""A short fingerprint of a loader item, to tell whether a resumed loader is where it should be.

Structure (mapping keys, sequence lengths, tensor dtypes and shapes) and contents (tensor bytes,
numbers, strings) go into one BLAKE2b digest. It is computed only when a state is saved and
when it is resumed, never per micro-batch: a tensor on an accelerator is copied to the host
then, once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["fingerprint"]


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

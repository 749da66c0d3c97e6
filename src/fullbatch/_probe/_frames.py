"""Look around the call stack for the engine's micro-batch around a forward.

Trainers often keep the labels out of the model's call (fullbatch's own ``ExactTrainer``, a
Lightning ``training_step`` that calls ``self(batch["input_ids"])``, a loop that computes its
loss outside the model). The micro-batch they came from is still a local variable of a frame
above the forward (``inputs``, ``batch``, ``micro``); :func:`find_micro` picks the one that holds
the very tensors the model received; :func:`find_labels` the ``labels``/``targets`` tensor
beside the model's input where the engine unpacked ``(inputs, targets)``. Nothing is written
to any frame.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from types import FrameType
from typing import Any

import torch

__all__ = ["find_labels", "find_micro"]

_MICRO_NAMES = ("inputs", "batch", "micro", "micro_batch", "mb", "data")
_LABEL_NAMES = ("labels", "label", "targets", "target", "y")
_DEPTH = 24
_MAX_ITEMS = 256
_HERE = os.path.dirname(os.path.abspath(__file__))


def _ours(frame: FrameType) -> bool:
    """Code of this package (by the file's folder: a doctest runs in a module's globals)."""
    return os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == _HERE


def _skipped(frame: FrameType) -> bool:
    name = frame.f_globals.get("__name__", "")
    return bool(name == "torch" or name.startswith("torch.") or _ours(frame))


def _holds(value: Any, ids: set[int]) -> bool:
    if id(value) in ids:
        return True
    if len(value) > _MAX_ITEMS:  # a data set or a table, not a micro-batch
        return False
    if isinstance(value, Mapping):
        return any(id(v) in ids for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(id(v) in ids for v in value)
    return False


def _has_labels(value: Any) -> bool:
    return isinstance(value, Mapping) and ("labels" in value or "shift_labels" in value)


def find_micro(ids: set[int]) -> Any:
    """The engine's micro-batch around a forward whose inputs are the objects in ``ids``.

    Looked for in the frames above the caller, nearest first: a mapping holding one of them
    and ``labels`` (under any name) wins; else the nearest ``inputs``/``batch``/``micro`` (or
    list or tuple under those names) holding one; else the nearest mapping holding one.

    >>> import torch
    >>> x = torch.ones(1)
    >>> b = {"x": x, "labels": torch.zeros(1)}
    >>> find_micro({id(x)}) is b
    True
    """
    frame: FrameType | None = sys._getframe(1)
    named = mapping = None
    looked = 0
    while frame is not None and looked < _DEPTH:
        if not _skipped(frame):
            looked += 1
            for name, value in frame.f_locals.items():
                if not isinstance(value, (Mapping, list, tuple)) or not _holds(value, ids):
                    continue
                if _has_labels(value):
                    return value
                if named is None and name in _MICRO_NAMES:
                    named = value
                if mapping is None and isinstance(value, Mapping):
                    mapping = value
        frame = frame.f_back
    return named if named is not None else mapping


def find_labels(ids: set[int]) -> Any:
    """Labels kept beside the model's input rather than in a mapping.

    In the nearest frame above that holds one of the tensors in ``ids`` (as a local, or inside
    a local tuple, list or mapping): a tensor named ``labels``, ``label``, ``targets``,
    ``target`` or ``y`` that does not require gradients (a model output left from the loop's
    previous iteration does). Engines that unpack ``(inputs, targets)`` keep them so
    (Super-Gradients, ``for x, y in loader``).

    >>> import torch
    >>> x, targets = torch.ones(2, 3), torch.zeros(2, dtype=torch.long)
    >>> find_labels({id(x)}) is targets
    True
    """
    frame: FrameType | None = sys._getframe(1)
    looked = 0
    while frame is not None and looked < _DEPTH:
        if not _skipped(frame):
            looked += 1
            found = frame.f_locals
            if any(
                id(v) in ids or (isinstance(v, (Mapping, list, tuple)) and _holds(v, ids))
                for v in found.values()
            ):
                for name in _LABEL_NAMES:
                    value = found.get(name)
                    if isinstance(value, torch.Tensor) and not value.requires_grad:
                        return value
        frame = frame.f_back
    return None

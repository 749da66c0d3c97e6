"""Look around the call stack for the engine's micro-batch around a forward.

Trainers often keep the labels out of the model's call (fullbatch's own ``ExactTrainer``, a
Lightning ``training_step`` that calls ``self(batch["input_ids"])``, a loop that computes its
loss outside the model). The micro-batch they came from is still a local variable of a frame
above the forward (``inputs``, ``batch``, ``micro``); :func:`find_micro` picks the one that holds
the very tensors the model received; :func:`find_labels` the ``labels``/``targets`` tensor
beside the model's input where the engine unpacked ``(inputs, targets)``, never one whose rows
are not the input's (a whole data set's); :func:`held_together` whether two forwards' inputs
are bound side by side in the loop's frame (``for q, k in loader``: one loop value unpacked).
Nothing is written to any frame.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, Sequence
from types import FrameType
from typing import Any

import torch

__all__ = ["find_labels", "find_micro", "held_together"]

_MICRO_NAMES = ("inputs", "batch", "micro", "micro_batch", "mb", "data")
#: A label's name: ``labels``, ``target``, ``y``..., bare or with a batch mark (``b_``,
#: ``batch_``, ``_batch``, ``b``, ...): ``yb``, ``y_batch``, ``target_batch``, ``b_labels``.
_LABEL_NAME = re.compile(
    r"^(b_|batch_|mb_|micro_)?(labels?|targets?|tgts?|y)(b|_b|_batch|_mb|_true)?$", re.IGNORECASE
)
_DEPTH = 24
_MAX_ITEMS = 256
#: Items of a loop value at most (``(q, k)``, ``(anchor, positive, negative)``); a longer
#: container is a list the loop appends to, not one iteration's value.
_LOOP_ITEMS = 8
_HERE = os.path.dirname(os.path.abspath(__file__))


def _ours(frame: FrameType) -> bool:
    """Code of this package (by the file's folder: a doctest runs in a module's globals)."""
    return os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == _HERE


#: Packages whose frames are a wrapper's, not the loop's (DeepSpeed's engine forward holds the
#: model's inputs as ``inputs``, as DDP's does).
_WRAPPERS = ("torch", "deepspeed")


def _skipped(frame: FrameType) -> bool:
    name = str(frame.f_globals.get("__name__", ""))
    return name.split(".")[0] in _WRAPPERS or _ours(frame)


def _holds(value: Any, ids: set[int]) -> bool:
    if id(value) in ids:
        return True
    if len(value) > _MAX_ITEMS:  # a data set or a table, not a micro-batch
        return False
    if isinstance(value, dict) and "__builtins__" in value:  # a module's namespace (runpy's
        return False  # frames hold the script's globals, and the script's variables are there)
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


def _label_rank(name: str) -> int | None:
    """0 for a name a loop gives one micro-batch's labels (``yb``, ``target_batch``,
    ``b_labels``), 1 for a bare one (``labels``, ``targets``, ``y``: maybe a whole data set's),
    None for any other name."""
    match = _LABEL_NAME.match(name)
    if match is None:
        return None
    return 0 if match.group(1) or match.group(3) else 1


def find_labels(inputs: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """Labels kept beside the model's input rather than in a mapping.

    In the nearest frame above that holds one of the model's tensor ``inputs`` (as a local, or
    inside a local tuple, list or mapping; a script's top level counts: its loop variables are
    module globals) and has such a tensor: one under a label's name (``labels``, ``targets``,
    ``target``, ``y``, or the same with a batch mark: ``yb``, ``y_batch``, ``target_batch``,
    ``b_labels``) that does not require gradients (a model output left from the loop's previous
    iteration does) and whose first dimension is the input's rows (a whole data set's ``y``
    beside a loop's ``xb`` is not its labels). A name with a batch mark wins over a bare one.
    Engines that unpack ``(inputs, targets)`` keep them so (Super-Gradients, ``for x, y in
    loader``, the book's ``for input_batch, target_batch in train_loader``).

    >>> import torch
    >>> x, targets = torch.ones(2, 3), torch.zeros(2, dtype=torch.long)
    >>> y = torch.zeros(50, dtype=torch.long)  # a whole data set's labels: not these rows
    >>> find_labels([x]) is targets
    True
    """
    ids = {id(t) for t in inputs}
    rows = {t.shape[0] for t in inputs if t.dim()}
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
                labels = _pick(found, rows)
                if labels is not None:
                    return labels
        frame = frame.f_back
    return None


def _pick(found: Mapping[str, Any], rows: set[int]) -> torch.Tensor | None:
    """The labels among one frame's variables (see :func:`find_labels`), or None."""
    best: tuple[int, torch.Tensor] | None = None
    for name, value in found.items():
        rank = _label_rank(name) if isinstance(name, str) else None
        if rank is None or not isinstance(value, torch.Tensor) or value.requires_grad:
            continue
        if not value.dim() or (rows and value.shape[0] not in rows):
            continue
        if best is None or rank < best[0]:
            best = (rank, value)
    return None if best is None else best[1]


def _bound(names: Mapping[str, Any]) -> set[int]:
    """The ids of the objects a frame binds: its variables, and the items of a small tuple,
    list or mapping among them (not a module's namespace)."""
    out: set[int] = set()
    for value in names.values():
        out.add(id(value))
        if isinstance(value, dict) and "__builtins__" in value:
            continue
        if isinstance(value, Mapping) and len(value) <= _LOOP_ITEMS:
            out.update(id(v) for v in value.values())
        elif isinstance(value, (list, tuple)) and len(value) <= _LOOP_ITEMS:
            out.update(id(v) for v in value)
    return out


def held_together(ids: set[int], others: set[int]) -> bool:
    """Whether the nearest frame above that binds one of ``ids`` (a forward's inputs) binds
    every one of ``others`` (an earlier forward's inputs) too: the two forwards ran on one
    loop value, unpacked (``for q, k in loader``, ``q, k = pair``), in one iteration. A loop
    over micro-batches rebinds its variable, so an earlier iteration's input is no longer
    bound there.

    >>> import torch
    >>> q, k = torch.ones(1), torch.zeros(1)
    >>> held_together({id(k)}, {id(q)}), held_together({id(k)}, {id(torch.ones(1))})
    (True, False)
    """
    frame: FrameType | None = sys._getframe(1)
    looked = 0
    while frame is not None and looked < _DEPTH:
        if not _skipped(frame):
            looked += 1
            bound = _bound(frame.f_locals)
            if bound & ids:
                return others <= bound
        frame = frame.f_back
    return False

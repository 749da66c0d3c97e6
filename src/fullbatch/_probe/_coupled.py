"""Micro-batches of a callable objective: several forwards of one micro-batch, and a loss that
couples the rows of a micro-batch.

- **One micro-batch, several forwards.** A callable objective receives the micro-batch as the
  loop holds it (``fn(model, micro)``), so forwards whose micro-batch is the same loop value
  (an encoder called on ``batch["q"]`` and then on ``batch["k"]`` in one iteration) are one
  micro-batch: :func:`one_per_micro` keeps the first call of each run, whose replay
  recomputes ``fn`` (and through it every forward) once.
- **A coupled loss.** The probe's reference is ``Σ_k ∇ fn(micro_k) / Σ_k count_k``: it is the
  full batch's only when ``fn`` sums per-item terms. :func:`coupling` evaluates ``fn`` on two
  micro-batches apart and together (no gradient, RNG forked, the module in eval mode and put
  back): where the whole is not the sum of its parts, rows interact (in-batch negatives), no
  accumulation of per-micro-batch losses equals the full batch's step, and the window is not
  judged per micro-batch: the report says so by name (``"coupled loss"``), never right.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from fullbatch._probe._capture import Call

__all__ = ["coupling", "one_per_micro"]

#: Relative difference between a whole micro-batch pair's loss and its parts' sum beyond which
#: the loss couples rows (float32 sums of a few hundred terms round to ~1e-6).
_COUPLED = 1e-4


def _leaves(value: Any, depth: int = 3) -> list[Any]:
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (list, tuple)) and depth > 0:
        return [leaf for v in value for leaf in _leaves(v, depth - 1)]
    return [value]


def _same(a: Any, b: Any) -> bool:
    """Whether two recorded micro-batches are the same loop value: the same tensors."""
    if a is None or b is None:
        return False
    left, right = _leaves(a), _leaves(b)
    tensors = [x for x in left if isinstance(x, torch.Tensor)]
    return (
        bool(tensors)
        and len(left) == len(right)
        and all(x is y for x, y in zip(left, right, strict=True))
    )


def one_per_micro(calls: list[Call]) -> tuple[list[Call], int]:
    """``calls`` with each run of consecutive calls of one module on one micro-batch kept once
    (the first), and how many were merged into another.

    >>> m = nn.Linear(1, 1)
    >>> micro = (torch.zeros(1), torch.ones(1))
    >>> calls = [Call(m, None, (), {}, None, (), micro=micro) for _ in range(2)]  # type: ignore
    >>> kept, merged = one_per_micro(calls)
    >>> len(kept), merged
    (1, 1)
    """
    kept: list[Call] = []
    for call in calls:
        last = kept[-1] if kept else None
        if last is not None and last.module is call.module and _same(last.micro, call.micro):
            continue
        kept.append(call)
    return kept, len(calls) - len(kept)


def _joined(a: Any, b: Any) -> Any:
    """Two micro-batches of one structure as one, rows concatenated; None where they cannot be
    (not tensors with rows, other structures)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        ok = a.dim() > 0 and a.shape[1:] == b.shape[1:]
        return torch.cat([a, b]) if ok else None
    if isinstance(a, Mapping) and isinstance(b, Mapping) and a.keys() == b.keys():
        out = {key: _joined(a[key], b[key]) for key in a}
        return None if any(v is None for v in out.values()) else out
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        parts = [_joined(x, y) for x, y in zip(a, b, strict=True)]
        return None if any(p is None for p in parts) else type(a)(parts)
    return None


def coupling(objective: Callable[..., Any], name: str, calls: list[Call]) -> str | None:
    """The sentence saying that ``objective`` couples the rows of a micro-batch, or None (it
    adds up, or the micro-batches cannot be joined to tell)."""
    if len(calls) < 2 or getattr(objective, "paired_rows", False):
        return None  # paired rows ([chosen; rejected]) join into other pairs: no test
    first, second = calls[0].user_micro(), calls[1].user_micro()
    both = _joined(first, second)
    if both is None:
        return None
    module = calls[0].module
    modes: dict[nn.Module, bool] = {m: m.training for m in module.modules()}
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            module.eval()
            s1, s2, s12 = (float(objective(module, m)[0]) for m in (first, second, both))
    except Exception:  # the replay at step() shows the objective's own error, if any
        return None
    finally:
        for m, training in modes.items():
            m.train(training)
    scale = abs(s1) + abs(s2)
    if not all(math.isfinite(v) for v in (s1, s2, s12)) or scale == 0:
        return None
    if abs(s12 - (s1 + s2)) <= _COUPLED * scale:
        return None
    return (
        f"coupled loss: cannot judge a coupled loss per micro-batch: objective {name} on "
        f"micro-batches 1 and 2 together gives {s12:.6g}, not the sum of their own losses "
        f"({s1:.6g} + {s2:.6g}), so rows interact inside a micro-batch (in-batch negatives, "
        "a batch statistic in the loss) and no sum over micro-batches equals the full batch's "
        "loss. Make the window's loss the full batch's with fb.Accumulator's "
        "window.run_coupled(encode, loss) (encode(micro) returns the representations, loss "
        "scores the whole window's), and check it with fb.verify; or declare a loss that is a "
        "sum of per-item terms"
    )

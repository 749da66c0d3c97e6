"""Micro-batches of a callable objective: several forwards of one micro-batch, and a loss that
couples the rows of a micro-batch.

- **One micro-batch, several forwards.** A callable objective receives the micro-batch as the
  loop holds it (``fn(model, micro)``), so the forwards of one loop iteration are one
  micro-batch; :func:`one_per_micro` keeps one call per micro-batch, whose replay recomputes
  ``fn`` (and through it every forward) once. The rule, for consecutive forwards of one module
  whose output reached a backward:

  1. the same loop value (``batch["q"]`` then ``batch["k"]``: the variable that holds both
     inputs is the micro-batch) joins the previous forward;
  2. no loop value found (the loop unpacked it: ``for step, (q, k) in enumerate(loader)``,
     ``for q, k in loader``, ``q, k = pair``): a forward joins the previous one where both
     reached the same ``backward()`` call and the previous forward's inputs were still bound
     beside its own in the loop's frame (one iteration: the next iteration rebinds them). The
     micro-batch ``fn`` receives is then that loop value rebuilt: a tuple of what each forward
     received, in the order they ran, and the labels found beside them if any (``(q, k)``;
     ``for a, p, y in loader`` gives ``(a, p, y)``).

  Forwards of one iteration that each reach their own ``backward()`` stay apart under rule 2
  (each backward is a separate loss), as does a loop that keeps every micro-batch's loss for
  one ``backward()`` at the window's end (its earlier inputs are no longer bound). "Bound"
  counts a variable and the items of a tuple, list or mapping variable of at most 8 items, so
  a loop over such a short list of bare input tensors with one ``backward()`` per window reads
  as one loop value (``fn`` then receives the tuple, and says so if it cannot take it).
- **A coupled loss.** The probe's reference is ``Σ_k ∇ fn(micro_k) / Σ_k count_k``: it is the
  full batch's only when ``fn`` sums per-item terms. :func:`coupling` evaluates ``fn`` on two
  micro-batches apart and together (no gradient, RNG forked, the module in eval mode and put
  back): where the whole is not the sum of its parts, rows interact (in-batch negatives), no
  accumulation of per-micro-batch losses equals the full batch's step, and the window is not
  judged per micro-batch: the report says so by name (``"coupled loss"``), never right, and
  says how to declare the objective coupled (:mod:`fullbatch._probe._whole` then judges the
  window against ``fn`` over the whole window).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from fullbatch._probe._capture import Call

__all__ = ["DECLARE", "coupling", "joined", "one_per_micro"]

#: How to declare a coupled objective, in the probe's texts.
DECLARE = (
    "fb.probe(objective=fn, coupled=True), or fullbatch probe --objective FILE.py:FN --coupled"
)

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


def _paired(last: Call, call: Call) -> bool:
    """Rule 2 of the module docstring: one unpacked loop value, one ``backward()``."""
    task = last.reach.task
    return call.with_previous and task is not None and call.reach.task == task


def _rebuilt(group: list[Call]) -> Call:
    """The group's first call, its micro-batch the loop value its forwards came from."""
    if len(group) == 1:
        return group[0]
    first = group[0]
    labels = first.targets
    same = labels is not None and all(c.targets is labels for c in group)
    micro = tuple(c.inputs() for c in group) + ((labels,) if same else ())
    return replace(first, micro=micro, targets=None)


def one_per_micro(calls: list[Call]) -> tuple[list[Call], int]:
    """One call per micro-batch of a callable objective (the module docstring's rule), and how
    many calls were merged into another.

    >>> m = nn.Linear(1, 1)
    >>> micro = (torch.zeros(1), torch.ones(1))
    >>> calls = [Call(m, None, (), {}, None, (), micro=micro) for _ in range(2)]  # type: ignore
    >>> kept, merged = one_per_micro(calls)
    >>> len(kept), merged
    (1, 1)
    """
    groups: list[list[Call]] = []
    for call in calls:
        last = groups[-1][-1] if groups else None
        if last is not None and last.module is call.module:
            if _same(last.micro, call.micro):
                continue
            if last.micro is None and call.micro is None and _paired(last, call):
                groups[-1].append(call)
                continue
        groups.append([call])
    return [_rebuilt(g) for g in groups], len(calls) - len(groups)


def joined(parts: list[Any]) -> Any:
    """Micro-batches of one structure as one, rows concatenated in order; None where they
    cannot be (not tensors with rows, other structures).

    >>> joined([(torch.zeros(2, 3), torch.ones(2)), (torch.zeros(1, 3), torch.ones(1))])[0].shape
    torch.Size([3, 3])
    """
    a = parts[0]
    if all(isinstance(p, torch.Tensor) for p in parts):
        ok = all(p.dim() > 0 and p.shape[1:] == a.shape[1:] for p in parts)
        return torch.cat(parts) if ok else None
    if all(isinstance(p, Mapping) and p.keys() == a.keys() for p in parts):
        out = {key: joined([p[key] for p in parts]) for key in a}
        return None if any(v is None for v in out.values()) else out
    if all(isinstance(p, (list, tuple)) and len(p) == len(a) for p in parts):
        items = [joined([p[i] for p in parts]) for i in range(len(a))]
        return None if any(v is None for v in items) else type(a)(items)
    return None


def coupling(objective: Callable[..., Any], name: str, calls: list[Call]) -> str | None:
    """The sentence saying that ``objective`` couples the rows of a micro-batch, or None (it
    adds up, or the micro-batches cannot be joined to tell)."""
    if len(calls) < 2 or getattr(objective, "paired_rows", False):
        return None  # paired rows ([chosen; rejected]) join into other pairs: no test
    first, second = calls[0].user_micro(), calls[1].user_micro()
    both = joined([first, second])
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
        f"loss. Declare it coupled ({DECLARE}) to compare the step with {name} over the whole "
        "window's rows as one batch; make the window's loss the full batch's with "
        "fb.Accumulator's window.run_coupled(encode, loss) (encode(micro) returns the "
        "representations, loss scores the whole window's; docs/coupled.md); or declare a loss "
        "that is a sum of per-item terms"
    )

"""``verify(..., objective=...)``: is ``loss_fn``'s count the declared objective's count?

A count in another unit (rows where the loss sums tokens, ``numel`` with padding, the batch
total for every micro-batch, a leftover ``/ K``) is self-consistent: fullbatch then equals the
full batch *of that loss*, and verify's comparison passes. Only a declared objective
(:mod:`fullbatch._proof._objective`) says what the count should be. Every ``loss_fn`` call
verify makes is recorded, and each micro-batch's count is compared with the objective's count
of the same rows (a callable objective's count comes from a forward without gradients).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from fullbatch._proof._objective import CHOICES, OBJECTIVES, canonical, objective_count

__all__ = ["DeclaredCounts"]


def _labels(micro: Any, key: str) -> torch.Tensor:
    value = micro.get(key) if isinstance(micro, Mapping) else None
    if not isinstance(value, torch.Tensor):
        keys = sorted(micro) if isinstance(micro, Mapping) else type(micro).__name__
        raise ValueError(
            f"objective= counts items from the batch's {key!r} (-100 where ignored); the batch "
            f"has {keys}. Pass a dict batch with {key!r}, or objective=fn(model, micro) -> "
            "(loss_sum, count)."
        )
    return value


def _count(objective: str, micro: Any) -> float:
    if objective == "causal_lm" and isinstance(micro, Mapping):
        if isinstance(micro.get("shift_labels"), torch.Tensor):
            return objective_count(objective, micro["shift_labels"], shifted=True)
    return objective_count(objective, _labels(micro, "labels"))


class DeclaredCounts:
    """Records ``loss_fn``'s count per call and checks it against ``objective``'s.

    >>> import torch, fullbatch as fb
    >>> batch = {"x": torch.randn(4, 2), "labels": torch.tensor([[1, 2, 3], [4, 5, -100]] * 2)}
    >>> declared = DeclaredCounts("causal_lm")
    >>> loss_fn = declared.wrap(lambda m, b: (torch.zeros(()), b["labels"].numel()))
    >>> _ = loss_fn(None, batch)
    >>> print(declared.cause(None).split(";")[0])
    loss_fn counts 12 item(s) where objective='causal_lm' counts 6 (x2)
    """

    def __init__(self, objective: str | Callable[..., Any]) -> None:
        objective = canonical(objective)
        if not callable(objective) and objective not in OBJECTIVES:
            raise ValueError(f"objective={objective!r} is not known; pass {CHOICES}.")
        self.objective = objective
        self._calls: list[tuple[Any, float]] = []

    def wrap(self, loss_fn: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(model: nn.Module, micro: Any, *args: Any) -> Any:
            out = loss_fn(model, micro, *args)
            if isinstance(out, tuple) and len(out) == 2:
                self._calls.append((micro, float(out[1])))
            return out

        return recorded

    def _declared(self, model: nn.Module, micro: Any) -> float:
        if isinstance(self.objective, str):
            return _count(self.objective, micro)
        with torch.no_grad():
            return float(self.objective(model, micro)[1])

    def cause(self, model: nn.Module) -> str | None:
        """A diagnosis line when a recorded count is not the objective's, else ``None``."""
        name = f"{self.objective!r}" if isinstance(self.objective, str) else "fn"
        for micro, got in self._calls:
            want = self._declared(model, micro)
            if math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9):
                continue
            ratio = f"x{got / want:.3g}" if want else "the objective counts none"
            return (
                f"loss_fn counts {got:g} item(s) where objective={name} counts {want:g} "
                f"({ratio}); a count in another unit (rows where the loss sums tokens, numel "
                "with padding, the batch total for every micro-batch, a leftover / K) scales "
                "every step and the weight of each micro-batch. Return the count of the items "
                "the summed loss contains: fb.causal_lm_loss / fb.cross_entropy_sum return it."
            )
        return None

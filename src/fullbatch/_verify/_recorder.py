"""``GradientRecorder``: an optimizer whose step records the gradient and changes nothing.

Handing it to an :class:`fullbatch.Accumulator` captures the exact gradient the Accumulator
would apply, which is how ``fb.verify`` and ``fullbatch demo`` compare recipes without
re-implementing accumulation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

__all__ = ["GradientRecorder"]


class GradientRecorder(torch.optim.Optimizer):
    """``step()`` keeps a copy of every parameter's gradient (``None`` where there is none).

    >>> w = torch.nn.Parameter(torch.zeros(2))
    >>> rec = GradientRecorder([w])
    >>> w.grad = torch.ones(2)
    >>> rec.step()
    >>> rec.recorded[0].tolist(), w.tolist()
    ([1.0, 1.0], [0.0, 0.0])
    """

    def __init__(self, params: Iterable[torch.nn.Parameter]) -> None:
        super().__init__(list(params), defaults={"lr": 0.0})
        self.recorded: list[torch.Tensor | None] | None = None

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        self.recorded = [
            None if p.grad is None else p.grad.detach().clone()
            for group in self.param_groups
            for p in group["params"]
        ]

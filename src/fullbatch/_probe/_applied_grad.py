"""The applied gradient of plain modules and DDP: each parameter's ``.grad`` at ``step()``.

DDP has averaged it over the ranks by then (or, under ``no_sync`` misuse, not: the window's
check compares ranks); a hand loop that all-reduces gradients itself has done so. Engines
that keep gradients elsewhere and have no reader of their own (:mod:`fullbatch._probe._applied`
lists those that do: DeepSpeed, FSDP2, tensor-parallel ``DTensor`` parameters) are refused
with their reason: FSDP1's flat parameters, ColossalAI's ZeRO/Gemini buffers (and a
``DTensor`` no other reader claimed).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from fullbatch._base._sync._probe import unsupported_wrapper
from fullbatch._probe._applied import Reader, Seen

__all__ = ["GradApplied", "unsupported_params"]


def unsupported_params(params: tuple[nn.Parameter, ...]) -> str | None:
    """Why gradients of ``params`` are not the full gradients at ``step()``, or None.

    >>> unsupported_params((nn.Parameter(torch.ones(1)),)) is None
    True
    """
    if any(getattr(p, "_is_flat_param", False) for p in params):
        return "the optimizer trains FSDP1 flat parameters, whose .grad is a flattened shard"
    if any(hasattr(p, "_local_tensor") for p in params):
        return "the optimizer trains DTensor parameters outside FSDP2 (tensor parallelism)"
    return None


class GradApplied(Reader):
    """``p.grad`` for every parameter (see the module docstring)."""

    name: ClassVar[str] = ".grad"

    @classmethod
    def claims(cls, seen: Seen) -> bool:
        return True  # the last reader: anything no other reader claims

    def applied(self) -> list[torch.Tensor | None]:
        return [p.grad for p in self.params()]

    def leftover(self) -> list[torch.Tensor | None]:
        return [p.grad for p in self.params()]

    def unsupported(self) -> str | None:
        for module in (*self.seen.wrappers, *self.seen.modules):
            why = unsupported_wrapper(module)
            if why is not None:
                return why
        return unsupported_params(self.seen.params)

"""The applied gradient of FSDP2 and HSDP (``fully_shard`` over a 1-D or a 2-D mesh): each
parameter's ``.grad``, a ``DTensor`` shard that FSDP2's backward hooks reduce-scattered (and,
under HSDP, all-reduced over the replicas), gathered whole with ``full_tensor()``.

**The reference under FSDP2's hooks.** The window's micro-batches are replayed through the model
as the run called it, FSDP2's hooks included: each replayed forward all-gathers the parameters
as the run's forwards did, and its backward runs FSDP2's pre- and post-backward hooks. The
reference differentiates with ``torch.autograd.grad`` against FSDP2's *unsharded* parameters
(:meth:`FSDPApplied.wrt`: the tensors the forward computes with; the sharded ``DTensor``
parameters are not in its graph), which returns this rank's whole gradient and writes no
``.grad``: FSDP2's post-backward hook then finds no unsharded gradient to reduce-scatter, the
sharded ``.grad`` the optimizer is about to apply stays as it was, and no parameter, optimizer
state or RNG stream changes (``tests/probe/test_probe_fsdp.py`` checks the parameters after
several steps bitwise against an unprobed run). The replays cost all-gathers, the same on every
rank: FSDP2 already requires every rank to run as many forwards as the others. FSDP2 over
tensor-parallel parameters is :mod:`fullbatch._probe._applied_dtensor`'s (claimed before this).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from fullbatch._base._sync._probe import is_fsdp, unsharded_params
from fullbatch._probe._applied import Reader, Seen

__all__ = ["FSDPApplied"]


def _whole(grad: torch.Tensor | None) -> torch.Tensor | None:
    """A gradient gathered whole: a ``DTensor`` through ``full_tensor()`` (a collective)."""
    if grad is None:
        return None
    full = getattr(grad, "full_tensor", None)
    return full() if callable(full) else grad


class FSDPApplied(Reader):
    """``p.grad.full_tensor()`` for every parameter of a ``fully_shard`` model."""

    name: ClassVar[str] = "FSDP2"

    @classmethod
    def claims(cls, seen: Seen) -> bool:
        tops = (*seen.modules, *seen.wrappers)
        return any(is_fsdp(m) for top in tops for m in top.modules())

    def _views(self) -> dict[int, torch.nn.Parameter]:
        views: dict[int, torch.nn.Parameter] = {}
        for top in (*self.seen.modules, *self.seen.wrappers):
            views.update(unsharded_params(top))
        return views

    def wrt(self) -> list[torch.Tensor]:
        views = self._views()
        return [views.get(id(p), p) for p in self.params()]

    def applied(self) -> list[torch.Tensor | None]:
        return [_whole(p.grad) for p in self.params()]

    def leftover(self) -> list[torch.Tensor | None]:
        return [_whole(p.grad) for p in self.params()]

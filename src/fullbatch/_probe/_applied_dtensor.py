"""The applied gradient of tensor-parallel ``DTensor`` parameters: tensor parallelism alone (a
1-D "tp" mesh), or under FSDP2 or HSDP (``fully_shard`` over the data dims of a 2-D or 3-D
mesh). Each parameter's ``.grad`` is a ``DTensor`` over the tensor-parallel dims (and FSDP2's),
gathered whole with ``full_tensor()``.

**Which ranks make a window** (:meth:`DTensorApplied.ranks`). The ranks of a tensor-parallel
dim run the same micro-batches (each computes a slice of the same activations): the window's
reference and its item count are summed over the data dims only, FSDP2's mesh
(``fullbatch._base._sync._probe.data_ranks``); with no FSDP2, a mesh that spans every rank is
tensor parallelism alone (this rank's window is the whole window); a DDP wrapper's group is
its own; otherwise a mesh beside other ranks needs the data-parallel group named
(``fb.probe(ranks=...)``), else the window is refused as unsupported, never summed over a
guess.

**The reference.** Replayed as the run called the model, its collectives included: a
tensor-parallel forward all-gathers or all-reduces activations as the run's did, on every rank
of the dim alike (the same micro-batches in the same order). ``torch.autograd.grad`` is taken
against the parameters themselves, or under FSDP2 against its unsharded parameters
(``DTensor`` objects over the tensor-parallel dims): no ``.grad`` is written, so FSDP2's
post-backward hook reduce-scatters nothing and the gradient the optimizer is about to apply
stays as it was. Each replayed gradient is gathered whole (:meth:`DTensorApplied.whole`) before
it is summed and sampled.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from fullbatch._base._sync._probe import (
    data_ranks,
    is_ddp,
    mesh_group,
    tensor_parallel,
    unsharded_params,
)
from fullbatch._probe._applied import Reader, Seen

__all__ = ["DTensorApplied"]


def _whole(grad: torch.Tensor | None) -> torch.Tensor | None:
    """A gradient gathered whole: a ``DTensor`` through ``full_tensor()`` (a collective over
    its mesh; a ``Partial`` placement is summed)."""
    if grad is None:
        return None
    full = getattr(grad, "full_tensor", None)
    return full() if callable(full) else grad


class DTensorApplied(Reader):
    """``p.grad.full_tensor()`` for every parameter of a tensor-parallel model (module
    docstring), FSDP2 or HSDP over its data dims or not."""

    name: ClassVar[str] = "DTensor (tensor parallel)"

    @classmethod
    def claims(cls, seen: Seen) -> bool:
        return tensor_parallel((*seen.params, *seen.extra), (*seen.modules, *seen.wrappers))

    def _tops(self) -> tuple[torch.nn.Module, ...]:
        return (*self.seen.modules, *self.seen.wrappers)

    def wrt(self) -> list[torch.Tensor]:
        views: dict[int, torch.nn.Parameter] = {}
        for top in self._tops():
            views.update(unsharded_params(top))
        return [views.get(id(p), p) for p in self.params()]

    def whole(self, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        return [_whole(g) for g in grads]

    def applied(self) -> list[torch.Tensor | None]:
        return [_whole(p.grad) for p in self.params()]

    def leftover(self) -> list[torch.Tensor | None]:
        return [_whole(p.grad) for p in self.params()]

    def _data(self) -> Any:
        """The window's ranks as said without a collective: a group, a mesh, "local" or None."""
        if self.seen.ranks is not None:
            return self.seen.ranks
        ddp = next((w for w in self.seen.wrappers if is_ddp(w)), None)
        if ddp is not None:
            return ddp.process_group
        return data_ranks(tuple(self.params()), self._tops())

    def ranks(self) -> Any:
        return mesh_group(self._data())

    def unsupported(self) -> str | None:
        if self._data() is not None:
            return None
        return (
            "tensor-parallel DTensor parameters on a mesh beside other ranks, with no FSDP2 to "
            "say which ranks hold other data; name the data-parallel process group: "
            "fb.probe(..., ranks=dp_mesh.get_group())"
        )

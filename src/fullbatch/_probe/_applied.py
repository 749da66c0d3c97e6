"""The applied gradient: what the optimizer is about to apply, read from wherever the engine
keeps it. One class per engine, picked here.

A reader implements :class:`AppliedGradient`; :func:`applied_gradient` asks each class of
:data:`READERS`, in order, whether it :meth:`~AppliedGradient.claims` the window (the engine's
wrapper, the parameters' type) and builds the first that does; the plain ``.grad`` reader
(:mod:`fullbatch._probe._applied_grad`) comes last and claims everything. A new engine is one
module with one class, and one line in ``READERS`` ahead of the ``.grad`` reader, e.g. FSDP2
(``DTensor`` gradients gathered with ``full_tensor()``), tensor parallelism (the same, with the
window's ranks the data dims only) or DeepSpeed
(its ZeRO partitions and offload buffers, read through the engine found among
``Seen.wrappers``). A reader's module imports its engine's package inside its methods, never
at import, and ``claims`` looks only at objects it is handed (``sys.modules`` for classes).

A reader subclasses :class:`Reader` for the answers most engines share and overrides where its
engine differs: which parameters stand for a flattened copy the engine steps
(:meth:`~AppliedGradient.params`, :meth:`~AppliedGradient.stepped`), what the reference must
differentiate where the forward runs on other tensors than the parameters
(:meth:`~AppliedGradient.wrt`: FSDP2's unsharded parameters) and how its gradients are made whole
(:meth:`~AppliedGradient.whole`), which ranks make a window (:meth:`~AppliedGradient.ranks`: the
data dims of a composed mesh), engine state the reference's
replays move (:meth:`~AppliedGradient.replaying`), a clip the engine applies itself
(:meth:`~AppliedGradient.clip`), and an engine step that steps the torch optimizer once per
parameter group (:meth:`~AppliedGradient.continues`).
"""

from __future__ import annotations

import contextlib
import importlib
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

__all__ = ["READERS", "AppliedGradient", "Reader", "Seen", "applied_gradient"]

#: ``module:class`` of every reader, most specific first; the ``.grad`` reader claims all.
READERS = (
    "fullbatch._probe._applied_deepspeed:DeepSpeedApplied",
    "fullbatch._probe._applied_dtensor:DTensorApplied",
    "fullbatch._probe._applied_fsdp:FSDPApplied",
    "fullbatch._probe._applied_grad:GradApplied",
)


@dataclass(frozen=True)
class Seen:
    """What the probe saw of a window, for a reader to decide and to read.

    Attributes:
        params: the tensors the optimizers step in the window, each once (the model's
            parameters, or the flattened partitions an engine steps instead: DeepSpeed ZeRO).
        modules: the modules that ran the window's micro-batches (wrappers looked through).
        wrappers: the wrappers they ran under (a DDP module, a DeepSpeed engine, ...).
        extra: the trainable parameters of the module that ran that no optimizer steps
            (differentiated for the weight fit, not compared).
        ranks: the probe's ``ranks`` argument (None: inferred).
    """

    params: tuple[nn.Parameter, ...]
    modules: tuple[nn.Module, ...] = ()
    wrappers: tuple[nn.Module, ...] = ()
    extra: tuple[nn.Parameter, ...] = ()
    ranks: Any = None


class AppliedGradient(Protocol):
    """Reads one engine's gradient; made per window by :func:`applied_gradient`."""

    #: a short name for reports (``".grad"``, ``"DeepSpeed ZeRO"``)
    name: ClassVar[str]

    @classmethod
    def claims(cls, seen: Seen) -> bool:
        """Whether this engine keeps the gradient of ``seen``'s window."""
        ...

    def params(self) -> list[nn.Parameter]:
        """The model's parameters read, in the order of :meth:`applied`: first the
        :meth:`stepped` ones, whose gradient is compared, then the module's other trainable
        parameters (``Seen.extra``)."""
        ...

    def stepped(self) -> int:
        """How many of :meth:`params` (a prefix) the optimizers step."""
        ...

    def wrt(self) -> list[torch.Tensor]:
        """What the reference differentiates for each of :meth:`params`: the parameter itself,
        or the tensor the engine's forward uses in its place (FSDP2's unsharded parameter)."""
        ...

    def whole(self, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """The reference's gradients of :meth:`wrt` as whole plain tensors (a tensor-parallel
        ``DTensor`` gradient gathered), in the same order; the rest as they are."""
        ...

    def ranks(self) -> Any:
        """The ranks whose micro-batches make one window (the data dims): a process group,
        ``"local"`` (this rank alone), or None: the default (the DDP wrapper's group, else the
        default group)."""
        ...

    def applied(self) -> list[torch.Tensor | None]:
        """At ``step()``: the whole gradient the optimizer will apply, one tensor per parameter
        (its full shape, on any device and in the dtype the engine keeps it; None: no
        gradient), after the engine's own accumulation scaling and synchronization, before the
        optimizer's step. Not written to by the caller."""
        ...

    def leftover(self) -> list[torch.Tensor | None]:
        """At the window's first forward: the gradient already present, as :meth:`applied`
        (all None when there is none). The caller keeps only a sample of it."""
        ...

    def unsupported(self) -> str | None:
        """Why this window's gradient cannot be read whole (said in the report), or None.
        Decided from what is known without reading (no collective)."""
        ...

    def misread(self) -> str | None:
        """At ``step()``, after reading (:meth:`applied`'s read, which may be a collective): why
        the gradient read is not the one the engine measured, or None."""
        ...

    def replaying(self) -> AbstractContextManager[None]:
        """Entered around the reference's replays: puts back any engine state the replayed
        forwards and backwards move through the engine's own hooks (DeepSpeed ZeRO-3 releases
        the parameters they gathered, as its step had)."""
        ...

    def clip(self) -> tuple[float, float, float] | None:
        """At ``step()``: ``(max_norm, norm before the clip, coefficient)`` of a clip the engine
        applies itself to :meth:`applied` (not through ``clip_grad_norm_``), or None."""
        ...

    def clip_setting(self) -> tuple[float, str] | None:
        """The max norm the engine is configured to clip at (0: off) and where that value comes
        from (``"DeepSpeed's default (the config leaves gradient_clipping out)"``), or None for
        an engine without a clip of its own: the judge compares it with the one the trainer was
        asked for."""
        ...

    def refused(self) -> str | None:
        """Why fullbatch's own routes refuse this engine's configuration (the reason and what
        they accept, from the one module of that engine's facts), or None."""
        ...

    def continues(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether a step of ``optimizer`` with no micro-batch since this window was read is the
        same engine step (DeepSpeed steps the torch optimizer once per parameter group)."""
        ...


class Reader:
    """What most readers answer alike: the parameters as seen, differentiated themselves, no
    clip of the engine's own, one ``step()`` per window, no gradient before the window."""

    name: ClassVar[str] = "reader"

    def __init__(self, seen: Seen) -> None:
        self.seen = seen

    def params(self) -> list[nn.Parameter]:
        return [*self.seen.params, *self.seen.extra]

    def stepped(self) -> int:
        return len(self.seen.params)

    def wrt(self) -> list[torch.Tensor]:
        return list(self.params())

    def whole(self, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        return grads

    def ranks(self) -> Any:
        return self.seen.ranks

    def leftover(self) -> list[torch.Tensor | None]:
        return [None] * len(self.params())

    def unsupported(self) -> str | None:
        return None

    def misread(self) -> str | None:
        return None

    def replaying(self) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def clip(self) -> tuple[float, float, float] | None:
        return None

    def clip_setting(self) -> tuple[float, str] | None:
        return None

    def refused(self) -> str | None:
        return None

    def continues(self, optimizer: torch.optim.Optimizer) -> bool:
        return False


def applied_gradient(seen: Seen) -> AppliedGradient:
    """The reader of the first class in :data:`READERS` that claims ``seen``.

    >>> reader = applied_gradient(Seen((nn.Parameter(torch.ones(2)),)))
    >>> type(reader).name, reader.applied(), reader.unsupported()
    ('.grad', [None], None)
    """
    for spec in READERS:
        module, _, name = spec.partition(":")
        cls = getattr(importlib.import_module(module), name)
        if cls.claims(seen):
            return cls(seen)
    raise RuntimeError(f"no gradient reader claims this window (readers: {READERS})")

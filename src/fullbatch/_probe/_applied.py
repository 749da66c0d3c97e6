"""The applied gradient: what the optimizer is about to apply, read from wherever the engine
keeps it. One class per engine, picked here.

A reader implements :class:`AppliedGradient`; :func:`applied_gradient` asks each class of
:data:`READERS`, in order, whether it :meth:`~AppliedGradient.claims` the window (the engine's
wrapper, the parameters' type) and builds the first that does; the plain ``.grad`` reader
(:mod:`fullbatch._probe._applied_grad`) comes last and claims everything. A new engine is one
module with one class, and one line in ``READERS`` ahead of the ``.grad`` reader, e.g. FSDP2
(``DTensor`` gradients gathered with ``full_tensor()``) or DeepSpeed
(``deepspeed.utils.safe_get_full_grad``, which needs the DeepSpeed engine: find it among
``Seen.wrappers``). A reader's module imports its engine's package inside its methods, never
at import, and ``claims`` looks only at objects it is handed (``sys.modules`` for classes).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch
from torch import nn

__all__ = ["READERS", "AppliedGradient", "Seen", "applied_gradient"]

#: ``module:class`` of every reader, most specific first; the ``.grad`` reader claims all.
READERS = ("fullbatch._probe._applied_grad:GradApplied",)


@dataclass(frozen=True)
class Seen:
    """What the probe saw of a window, for a reader to decide and to read.

    Attributes:
        params: the parameters whose gradient is compared: every optimizer's stepped in the
            window (then those of the module that ran that no optimizer trains), each once.
        modules: the modules that ran the window's micro-batches (wrappers looked through).
        wrappers: the wrappers they ran under (a DDP module, a DeepSpeed engine, ...).
    """

    params: tuple[nn.Parameter, ...]
    modules: tuple[nn.Module, ...] = ()
    wrappers: tuple[nn.Module, ...] = ()


class AppliedGradient(Protocol):
    """Reads one engine's gradient; made per window by :func:`applied_gradient`."""

    #: a short name for reports (``".grad"``, ``"DeepSpeed ZeRO"``)
    name: ClassVar[str]

    @classmethod
    def claims(cls, seen: Seen) -> bool:
        """Whether this engine keeps the gradient of ``seen``'s window."""
        ...

    def params(self) -> list[nn.Parameter]:
        """The parameters read, in the order of :meth:`applied` (``seen.params``)."""
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
        """Why this window's gradient cannot be read whole (said in the report), or None."""
        ...


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

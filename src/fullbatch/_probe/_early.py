"""The reference on the engine's own forward: each micro-batch's gradient taken, at the end of its
forward, from the graph the model just built, instead of replaying the forward at ``step()``.

Why: a replay runs each micro-batch's forward a second time; differentiating the declared
objective of the logits the model just returned (``torch.autograd.grad(...,
retain_graph=True)``) costs one backward per micro-batch, and the band one more backward on the
same graph (the loss scaled by ``1 / d``: the backward's rounding; the forward is the one the
applied gradient came from, so it adds none). A probed window then costs the engine's window
plus about two thirds of it (``benchmarks/probe_cost.py``).

Where: a built-in objective whose logits are in the model's output (not TRL's fused LM head, not
a tuple that starts with the model's own loss), labels found, on a module whose parameters are
plain ``nn.Parameter`` objects (a plain module, or one under DDP, whose reducer hooks live on the
gradient accumulators that ``torch.autograd.grad`` never runs). Everything else (a callable
objective, which runs the model itself; a MoE model's ``causal_lm+moe``, whose aux term needs
the window's routing counts first; FSDP, DeepSpeed ZeRO-3 or ColossalAI Gemini, whose
backward hooks would reduce) is replayed at ``step()`` by :mod:`fullbatch._probe._reference`,
as is a whole window whose calls are not exactly those differentiated here (a forward the
window left out).

Nothing changes: no forward runs (no RNG draw, no BatchNorm update), ``torch.autograd.grad``
writes no ``.grad``, and the graph stays whole for the engine's own backward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fullbatch._base._sync._fsdp import is_fsdp
from fullbatch._base._sync._probe import is_ddp, unsupported_wrapper
from fullbatch._probe._call_loss import on_output
from fullbatch._probe._capture import Call
from fullbatch._probe._moe_objective import MOE, moe_kind
from fullbatch._probe._reference import LocalReference, add_into
from fullbatch._probe._replay import grads_of
from fullbatch._probe._sample import Sampler
from fullbatch._proof._objective import OBJECTIVES, infer_objective

__all__ = ["EarlyReference", "Taken", "plain"]

#: Packages whose engines keep parameters or hooks the early backward must not run through.
_SHARDING = ("deepspeed", "colossalai")


def plain(module: nn.Module) -> bool:
    """Whether ``module``'s parameters are plain ``nn.Parameter`` objects of no sharding engine
    (no FSDP ``DTensor`` or flat parameter, no DeepSpeed ZeRO-3 partition) and no module in it
    belongs to one.

    >>> plain(nn.Linear(2, 2))
    True
    """
    if any(type(p) is not nn.Parameter or hasattr(p, "ds_id") for p in module.parameters()):
        return False
    return not any(
        type(m).__module__.split(".")[0] in _SHARDING
        or is_fsdp(m)  # FSDP2, as the engine tells it
        or unsupported_wrapper(m) is not None  # FSDP1 and ColossalAI's wrappers
        for m in module.modules()
    )


@dataclass(kw_only=True)
class Taken(LocalReference):
    """One module's micro-batches of the current window, differentiated at their forwards.

    Attributes:
        params: the parameters differentiated (the sampler's: the module's trainable ones);
            ``ref`` is in their order, ``samples`` and ``counts`` in call order (the
            :class:`~fullbatch._probe._reference.LocalReference` fields, band included).
        calls: the ids of the calls taken, in order (a window is served only when they are its
            calls; ids, not the calls, so that no cycle keeps the gradients alive after the
            window: a call holds its ``Taken``, and the capture holds the calls until then).
        broken: a call could not be taken: the window is replayed.
    """

    params: list[nn.Parameter]
    calls: list[int] = field(default_factory=list)
    broken: bool = False

    def serves(self, calls: list[Call]) -> bool:
        """Whether these are exactly the calls taken here, in order."""
        return (
            not self.broken
            and len(calls) == len(self.calls)
            and all(id(a) == b for a, b in zip(calls, self.calls, strict=True))
        )


class EarlyReference:
    """The capture's ``on_call``: differentiates each call where it can (module docstring).

    ``objective``: the probe's (a name or None; a callable is never taken here);
    ``sampler_for``: the probe's sampler per module.
    """

    def __init__(self, objective: Any, sampler_for: Callable[[nn.Module], Sampler]) -> None:
        self._objective = objective
        self._sampler_for = sampler_for
        self._taken: dict[int, Taken] = {}
        self._plain: dict[int, bool] = {}
        self._kind: dict[int, str | None] = {}
        self._k_hint = 1  # micro-batches of the last window: the band's divisor, as a 1/N

    def new_window(self) -> None:
        """The window ended: what was taken belongs to its calls now."""
        if self._taken:
            self._k_hint = max(len(t.calls) for t in self._taken.values())
        self._taken = {}

    def _kind_of(self, module: nn.Module) -> str | None:
        key = id(module)
        if key not in self._kind:
            kind = None
            if self._objective in OBJECTIVES:
                kind = self._objective
            elif self._objective is None:
                try:
                    kind = infer_objective(module)
                except ValueError:
                    kind = None  # the replay raises, naming the choices
                if kind is not None and moe_kind(kind, module, declared=False) == MOE:
                    kind = None  # its aux term needs the window's routing: replayed at step()
            self._kind[key] = kind
        return self._kind[key]

    def __call__(self, call: Call, output: Any) -> None:
        module = call.module
        kind = self._kind_of(module)
        if kind is None:
            return
        if id(module) not in self._plain:
            self._plain[id(module)] = plain(module) and (
                call.wrapper is None or is_ddp(call.wrapper)
            )
        if not self._plain[id(module)]:
            return
        taken = self._taken.get(id(module))
        if taken is None:
            params = self._sampler_for(module).params
            taken = self._taken[id(module)] = Taken(params=params, ref=[None] * len(params))
        if taken.broken:
            return
        try:
            self._take(taken, call, kind, output)
        except Exception:  # (the replay at step() raises it, or checks another way)
            taken.broken = True

    def _take(self, taken: Taken, call: Call, kind: str, output: Any) -> None:
        with torch.enable_grad():
            loss = on_output(kind, call, output)
            if loss is None or not loss[0].requires_grad:
                taken.broken = True
                return
            loss_sum, count = loss
            grads = grads_of(loss_sum, taken.params, retain=True)
            sampler = self._sampler_for(call.module)
            sample = sampler.take(grads)
            if taken.delta is None and count > 0:
                divisor = 3.0 * count * self._k_hint  # like 1 / N: no power of two
                again = grads_of(loss_sum / divisor, taken.params, retain=True)
                taken.note_band(grads, again, sample, sampler.take(again), divisor, count)
                del again
        add_into(taken.ref, grads)
        taken.samples.append(sample)
        taken.counts.append(count)
        taken.calls.append(id(call))
        call.early = taken

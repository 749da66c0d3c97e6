"""``Engine``: what a window needs from its Accumulator, as one value of services and plans.

Every helper of the engine takes an :class:`Engine` (and the window's state), never the
Accumulator: the Accumulator builds one in its constructor and hands it down, so imports run
from the Accumulator to the helpers and never back. The drivers see the user's window through
:class:`Handle`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol

import torch
from torch import nn

from fullbatch._base._stats import StepStats
from fullbatch._base._sync import Sync
from fullbatch._base._verdict import Verdict, WindowCounters
from fullbatch._engine._batchnorm import WindowBatchNorm
from fullbatch._engine._guards import LoopGuard
from fullbatch._engine._hooks import WindowHooks
from fullbatch._engine._micro_plan import MicroBatchPlan
from fullbatch._engine._precision import GradBuffers
from fullbatch._engine._prepared import Prepared
from fullbatch._engine._state import WindowState
from fullbatch._engine._step_plan import StepPlan
from fullbatch._engine._watch import Watches

__all__ = ["Engine", "Handle"]


@dataclass(eq=False)
class Engine:
    """The Accumulator's services, plans, counters and open window (one per Accumulator).

    The options are not fields: they are parsed once into the two plans, which the helpers
    ask (``engine.micro_plan.is_auto``, ``engine.step_plan.scaler``), and the wrapper's facts
    are the sync's capabilities (``engine.sync.syncs_in_backward``).

    >>> import dataclasses
    >>> [f.name for f in dataclasses.fields(Engine)][:3]
    ['model', 'optimizer', 'params']
    """

    # -- services --------------------------------------------------------------------------
    model: nn.Module
    optimizer: torch.optim.Optimizer
    params: list[nn.Parameter]
    sync: Sync
    guard: LoopGuard  # a hand loop's leftovers (its sentinel gradient is one of the watches)
    prepared: Prepared
    window_hooks: WindowHooks
    watches: Watches  # the checks of the user's loop, told each micro-batch (_checks.py)
    grad_buffers: GradBuffers | None  # accumulate_dtype's float32 buffers
    batchnorm: WindowBatchNorm | None  # batchnorm="window"'s statistics
    pack_check: Any  # pack=True with verify_pack: the first window's check (_verify_pack)
    # -- plans: the options, parsed once ---------------------------------------------------
    micro_plan: MicroBatchPlan  # how a loader item becomes micro-batches
    step_plan: StepPlan  # scheduler, scaler, clip, accumulation dtype, BatchNorm statistics
    # -- counters --------------------------------------------------------------------------
    counters: WindowCounters = field(default_factory=WindowCounters)  # steps, skipped windows
    loss_scale: float | None = None  # c of the next window; None before the first
    start_problems: int = 0  # resume problems found before the next window start (_resume_check)
    verdict: Verdict | None = None  # the last window's verdict, published before its step
    # -- the window slot -------------------------------------------------------------------
    window: WindowState | None = None  # the open window: set by open_window, cleared by end
    pending: dict[str, Any] | None = None  # a loaded state, restored into the next window
    closed: bool = False

    @cached_property
    def stat_device(self) -> torch.device:
        """Where the window's numbers live: the collectives' device, or the parameters'."""
        return self.params[0].device if self.sync.group is None else self.sync.device

    def clear_grads(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.params:
            p.grad = None
        if self.grad_buffers is not None:
            self.grad_buffers.clear()


class Handle(Protocol):
    """What the drivers use of a window: the user's own calls, plus its engine and state."""

    _engine: Engine
    _state: WindowState

    def __iter__(self) -> Iterator[Any]: ...

    def backward(self, loss: torch.Tensor, count: Any = None, **autograd_kwargs: Any) -> None: ...

    def step(self) -> StepStats: ...

    @property
    def is_padding(self) -> bool: ...

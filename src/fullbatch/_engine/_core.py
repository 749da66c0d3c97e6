"""``Engine``: what a window needs from its Accumulator, as one value of services and options.

Every helper of the engine takes an :class:`Engine` (and the window's state), never the
Accumulator: the Accumulator builds one in its constructor and hands it down, so imports run
from the Accumulator to the helpers and never back. The drivers see the user's window through
:class:`Handle`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from fullbatch._base._autosize import AutoSize
from fullbatch._base._stats import StepStats
from fullbatch._base._sync import Sync
from fullbatch._base._verdict import WindowCounters
from fullbatch._engine._batchnorm import WindowBatchNorm
from fullbatch._engine._guards import LoopGuard
from fullbatch._engine._hooks import WindowHooks
from fullbatch._engine._mistakes import MistakeChecks
from fullbatch._engine._precision import GradBuffers
from fullbatch._engine._prepared import Prepared
from fullbatch._engine._state import WindowState

__all__ = ["Engine", "Handle"]


@dataclass(eq=False)
class Engine:
    """The Accumulator's services, options and counters (one per Accumulator).

    >>> import dataclasses
    >>> [f.name for f in dataclasses.fields(Engine)][:3]
    ['model', 'optimizer', 'params']
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    params: list[nn.Parameter]
    sync: Sync
    guard: LoopGuard
    prepared: Prepared
    window_hooks: WindowHooks
    scheduler: Any
    scaler: Any  # an enabled GradScaler, or None
    precision: GradBuffers | None  # accumulate_dtype's float32 buffers
    batchnorm: WindowBatchNorm | None
    auto: AutoSize | None  # an "auto" size
    split: Callable[[Any], list[Any]]  # how a loader item becomes micro-batches
    counts: dict[str, Callable[[Any], Any]] | None
    padding_micro_batch: Callable[[], Any] | None
    partial_window: str
    micro_batches: int | None
    micro_batch_size: int | None
    micro_batch_tokens: int | None
    sort_rows: bool
    max_grad_norm: float | None
    stat_device: torch.device
    mistakes: MistakeChecks  # migration mistakes caught before backward (_mistakes.py)
    counters: WindowCounters = field(default_factory=WindowCounters)  # steps, skipped windows
    loss_scale: float | None = None  # c of the next window; None before the first
    closed: bool = False
    window: WindowState | None = None  # the open window: set by open_window, cleared by end
    pending: dict[str, Any] | None = None  # a loaded state, restored into the next window
    start_problems: int = 0  # resume problems found before the next window start (_resume_check)
    pack: bool = False  # pack=True: micro-batches are packed rows (_base._packed)
    pack_check: Any = None  # pack=True: the first window's packing check (_verify_pack)

    def clear_grads(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.params:
            p.grad = None
        if self.precision is not None:
            self.precision.clear()


class Handle(Protocol):
    """What the drivers use of a window: the user's own calls, plus its engine and state."""

    _engine: Engine
    _state: WindowState

    def __iter__(self) -> Iterator[Any]: ...

    def backward(self, loss: torch.Tensor, count: Any = None, **autograd_kwargs: Any) -> None: ...

    def step(self) -> StepStats: ...

    @property
    def is_padding(self) -> bool: ...

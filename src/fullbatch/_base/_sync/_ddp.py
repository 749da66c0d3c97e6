"""DDP: ``require_backward_grad_sync`` per micro-batch, or one summed reduction at the step.

``require_backward_grad_sync`` is set per micro-batch (what ``no_sync()`` sets, without holding
a context open across a ``yield``), or kept off and reduced at the step (``ddp_sync="step"``).

An ``"auto"`` micro-batch size needs ``"step"``: a rank that runs out of memory must be able
to stop anywhere, so no collective may run inside a forward or backward
(:mod:`fullbatch._engine._auto`); with ``"last"`` DDP all-reduces inside the backward of each
rank's last micro-batch. ``ddp_sync=None`` (the default) is therefore ``"step"`` with an
"auto" size and ``"last"`` otherwise; an explicit ``"last"`` with "auto" raises.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Literal, get_args

import torch
from torch import nn

from fullbatch._base._sync._base import Sync, sum_tensors

__all__ = ["DDP_SYNC_MODES", "DDPSync", "DdpSync"]

DdpSync = Literal["last", "step"]
DDP_SYNC_MODES: tuple[str, ...] = get_args(DdpSync)


def _mode(mode: str | None, auto: str | None) -> str:
    """``ddp_sync`` as DDP runs it; ``auto``: the public name of an "auto" size, or None."""
    if mode is None:
        return "step" if auto is not None else "last"
    if mode == "last" and auto is not None:
        raise ValueError(
            f"{auto}='auto' under DDP needs ddp_sync='step', got ddp_sync='last': a rank that "
            "runs out of memory must be able to stop at any point, but with 'last' DDP "
            "all-reduces inside the backward of each rank's last micro-batch, where the other "
            "ranks would wait for it. Drop ddp_sync= (with an 'auto' size it is 'step') or "
            f"give ddp_sync='step'; or give an integer {auto}."
        )
    return mode


class DDPSync(Sync):
    kind = "ddp"

    def __init__(
        self, model: nn.Module, mode: str | None, divisor: float | None, *, auto: str | None = None
    ) -> None:
        super().__init__(model)
        self.group = model.process_group
        self.grad_group = self.group  # the wrapper's group (the counting group may be wider)
        self.mode = _mode(mode, auto)
        self.reduce_at_step = self.mode == "step"
        self.syncs_in_backward = not self.reduce_at_step
        self.needs_wrapper_forward = not self.reduce_at_step
        # DDP averages over its group; summing ourselves at the step divides by nothing.
        self.divisor = 1.0 if self.reduce_at_step else float(divisor or self.world)
        # static_graph=True records the graph in DDP's first synced iteration and breaks when
        # that iteration runs under no_sync (pytorch#143580): the first window syncs every
        # micro-batch (still exact: the average is linear), so ranks run equally many.
        self.static_graph = bool(getattr(model, "static_graph", False))
        self._first_window = True
        self._saved: bool | None = None

    @property
    def equal_micro_batches(self) -> bool:  # type: ignore[override]
        return self.static_graph and self._first_window and not self.reduce_at_step

    @property
    def inner(self) -> nn.Module:
        return self.model.module

    @contextlib.contextmanager
    def no_collectives(self) -> Iterator[None]:
        # No gradient sync, and no buffer broadcast in the forward (require_forward_param_sync).
        broadcast = self.model.require_forward_param_sync
        self.model.require_forward_param_sync = False
        try:
            with self.model.no_sync():
                yield
        finally:
            self.model.require_forward_param_sync = broadcast

    def begin(self, final: bool) -> None:
        if self._saved is None:
            self._saved = self.model.require_backward_grad_sync
        # DDP decides at forward time whether the coming backward reduces: set it before.
        sync = final or self.equal_micro_batches
        self.model.require_backward_grad_sync = sync and not self.reduce_at_step

    def finish_window(self) -> None:
        self._first_window = False

    def single_backward(self, final: bool) -> bool:
        return (final or self.equal_micro_batches) and not self.reduce_at_step

    def end(self) -> None:
        if self._saved is not None:
            self.model.require_backward_grad_sync = self._saved
            self._saved = None

    def forward_collective_modules(self) -> list[nn.Module]:
        # With broadcast_buffers, DDP broadcasts rank 0's buffers at the start of a forward
        # that follows a synchronized one: under "auto" (never synchronized), the first.
        return [self.model] if self.forward_collective() else []

    def forward_collective(self) -> bool:
        return bool(self.model.will_sync_module_buffers())

    def reduce_gradients(self, params: list[nn.Parameter]) -> None:
        for p in params:
            if p.grad is None:  # unused here, maybe used on another rank: reduce zeros
                p.grad = torch.zeros_like(p)
        self.reduce_tensors([p.grad for p in params if p.grad is not None])

    def reduce_tensors(self, tensors: list[torch.Tensor]) -> None:
        self._last_work = sum_tensors(tensors, self.grad_group)

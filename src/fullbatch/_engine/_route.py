"""DDP: a forward through ``ddp.module`` instead of the wrapper, caught before its backward.

DDP decides in its own ``forward`` whether the coming backward reduces gradients over ranks:
it prepares its reducer there. A forward through the inner module (``ddp.module(x)``) skips
that, so the backward of the micro-batch that should synchronize reduces nothing; each rank
steps with its own gradient divided by the world size (replicas diverge; measured on 2 ranks:
98% off the full batch, the two ranks' updates 136% apart).

Forward pre-hooks on the wrapper and on the inner module tell the two apart: an inner forward
with gradients on that no wrapper forward encloses. The decision is local and certain on every
rank: SPMD code makes the same call on each rank, and each rank raises at its first backward of
that micro-batch, before any collective of the window's backward or step. Only with
``ddp_sync="last"`` (DDP reduces in the backward); with ``ddp_sync="step"`` fullbatch reduces
the gradients itself and the inner forward is exact. The hooks live for the first window: the
watch drops out of the list at the first micro-batch of a later one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fullbatch._base._sync import Sync
from fullbatch._engine._state import WindowState
from fullbatch._engine._watch import Watch

__all__ = ["ForwardRoute"]


class ForwardRoute(Watch):
    """Watches which forward a DDP micro-batch went through (the first window).

    >>> wrapper = torch.nn.Sequential(torch.nn.Linear(2, 2))  # stands in for DDP
    >>> route = ForwardRoute(wrapper, wrapper[0])
    >>> route.start_micro_batch()
    >>> _ = wrapper[0](torch.zeros(1, 2))  # the inner module alone
    >>> print(route.message(0).split(":")[0])
    the forward of micro-batch 0 went through the DDP wrapper's inner module (model.module(...))
    >>> route.start_micro_batch()
    >>> _ = wrapper(torch.zeros(1, 2))  # through the wrapper
    >>> route.message(1) is None
    True
    >>> route.close()
    """

    def __init__(self, wrapper: nn.Module, inner: nn.Module) -> None:
        self._depth = 0  # wrapper forwards running now
        self._wrapped = False  # a wrapper forward ran for this micro-batch
        self._alone = False  # an inner forward with grad ran outside any wrapper forward
        self._windows = 0  # windows begun
        self._handles = [
            wrapper.register_forward_pre_hook(self._enter),
            wrapper.register_forward_hook(self._leave, always_call=True),
            inner.register_forward_pre_hook(self._inner),
        ]

    @classmethod
    def watching(cls, model: nn.Module, sync: Sync) -> ForwardRoute | None:
        """The watch for a wrapper whose sync needs its own forward (DDP, ``ddp_sync="last"``)."""
        inner = getattr(model, "module", None)
        if sync.needs_wrapper_forward and isinstance(inner, nn.Module):
            return cls(model, inner)
        return None

    # -- the Watch ---------------------------------------------------------------------------

    def on_micro_batch(self, state: WindowState, micro: Any) -> bool:
        if state.yielded == 1:
            self._windows += 1
            if self._windows > 1:
                return True  # a second window begins: the first one's checks are done
        self.start_micro_batch()
        return False

    def before_backward(self, state: WindowState, loss: torch.Tensor, count: Any) -> None:
        if state.current_backwards == 0:
            message = self.message(state.yielded - 1)
            if message is not None:
                raise RuntimeError(message)

    # -- the hooks ---------------------------------------------------------------------------

    def _enter(self, module: nn.Module, args: Any) -> None:
        self._depth += 1
        self._wrapped = True

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        self._depth = max(self._depth - 1, 0)

    def _inner(self, module: nn.Module, args: Any) -> None:
        if self._depth == 0 and torch.is_grad_enabled():
            self._alone = True

    def start_micro_batch(self) -> None:
        self._wrapped = self._alone = False

    def message(self, index: int) -> str | None:
        """Why the backward of micro-batch ``index`` must not run, or None."""
        if not self._alone or self._wrapped:
            return None
        return (
            f"the forward of micro-batch {index} went through the DDP wrapper's inner module "
            "(model.module(...)): DDP synchronizes gradients only after a forward through the "
            "wrapper, so this rank would step with its own gradient and the replicas would "
            "diverge. Nothing was changed. Call the wrapper, `ddp_model(**inputs)` (the model "
            "given to the Accumulator), or build the Accumulator with ddp_sync='step', which "
            "reduces gradients at window.step() whatever forward ran."
        )

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

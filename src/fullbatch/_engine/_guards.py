"""Catching leftovers of a hand-written loop, which would otherwise train silently wrong.

Users migrate by deleting code, and sometimes they miss a line:

- a stray ``optimizer.step()`` inside the window steps with an un-normalized, partial gradient:
  an optimizer step pre-hook refuses any step that fullbatch did not start while a window is
  open (before anything changes), but DCP's own zero-learning-rate step that initialises an
  optimizer's state (:mod:`fullbatch._engine._dcp`);
- a stray ``optimizer.zero_grad()`` (or ``model.zero_grad()``) between two micro-batches throws
  away the window's gradient so far, and a stray ``loss.backward()`` or ``clip_grad_norm_``
  mixes in unnormalized or clipped terms: after every backward one *sentinel* gradient is
  remembered (the tensor and its version counter); before the next backward and at the step it
  must be the same tensor, unmodified. These calls touch every gradient, so one sentinel is
  enough and the check costs a few attribute reads per micro-batch;
- a stray ``scheduler.step()`` next to ``scheduler=`` decays the learning rate twice as fast:
  the scheduler's ``last_epoch`` must not move outside fullbatch;
- an optimizer re-created after the Accumulator was built is not the one fullbatch steps: a
  step of *another* optimizer over the model's parameters while ``acc.windows(loader)`` is
  being iterated (inside a window, where it would apply a partial gradient, or between two,
  where it shows the loop believes it trains with that optimizer) is refused before it changes
  anything (a global optimizer step pre-hook, registered only during the iteration). Its
  learning rate, and a scheduler built on it, would never apply. A re-created optimizer that
  is never stepped cannot be seen: ``stats.lr`` reports the learning rate really used.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fullbatch._engine._dcp import DcpInitStep
from fullbatch._engine._state import WindowState
from fullbatch._engine._watch import Watch

__all__ = ["LoopGuard"]

_STEP_FIX = (
    "window.step() normalizes the gradient and steps the optimizer once per window: delete "
    "your own optimizer.step() (and zero_grad(), clip_grad_norm_, scheduler.step()) calls."
)


class LoopGuard(Watch):
    """Watches the optimizer, the gradients and the scheduler for calls fullbatch did not make.

    The gradient check is a :class:`~fullbatch._engine._watch.Watch` (before and after each
    backward, before the step); the optimizer's and the scheduler's are hooks and reads.

    >>> import torch
    >>> w = torch.nn.Parameter(torch.zeros(2))
    >>> opt = torch.optim.SGD([w], lr=0.1)
    >>> guard = LoopGuard(opt, None, [w])
    >>> guard.window_open = True
    >>> try:
    ...     opt.step()
    ... except RuntimeError as error:
    ...     print(str(error).split(":")[0])
    optimizer.step() was called inside window 0, before window.step()
    >>> guard.close()
    """

    def __init__(self, optimizer: torch.optim.Optimizer, scheduler: Any, params: list[Any]):
        self._params = params
        self._scheduler = scheduler
        self.window_open = False
        self.window_index = 0
        self.stepping = False  # fullbatch itself is stepping the optimizer
        self._iterations = 0  # acc.windows(loader) iterations running now
        self._sentinel: Any = None
        self._sentinel_grad: torch.Tensor | None = None
        self._sentinel_version = 0
        self._epoch = self._scheduler_epoch()
        self._optimizer = optimizer
        self._ids = {id(p) for p in params}
        self._handle = optimizer.register_step_pre_hook(self._before_step)
        self._any_handle: Any = None  # the global hook, while a window is open
        self._dcp = DcpInitStep(optimizer, params)

    # -- optimizer.step ----------------------------------------------------------------------

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        stray = self.window_open and not self.stepping
        if stray and not self._dcp.allow(optimizer, self.window_index):
            raise RuntimeError(
                f"optimizer.step() was called inside window {self.window_index}, before "
                f"window.step(): the gradient is not yet normalized nor complete. {_STEP_FIX}"
            )

    def _before_any_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Any optimizer's step while a window is open: another one over our parameters?"""
        if self.stepping or optimizer is self._optimizer:
            return
        groups = getattr(optimizer, "param_groups", [])
        if not any(id(p) in self._ids for group in groups for p in group.get("params", [])):
            return
        lr = groups[0].get("lr") if groups else None
        ours = self._optimizer.param_groups[0].get("lr") if self._optimizer.param_groups else None
        where = "inside" if self.window_open else "after"
        raise RuntimeError(
            f"{type(optimizer).__name__}.step() (lr={lr}) was called {where} window "
            f"{self.window_index} on an optimizer over the model's parameters that is not the "
            f"one the Accumulator steps ({type(self._optimizer).__name__}, lr={ours}): an "
            "optimizer re-created after the Accumulator was built? fullbatch steps only the "
            "optimizer it was given, so the new one's learning rate (and a scheduler built on "
            "it) would never apply. Build the Accumulator after the optimizer, "
            "`fb.Accumulator(model, optimizer, ...)`, and delete the optimizer.step() call: "
            "window.step() steps it once per window. Nothing was changed."
        )

    # -- zero_grad between backward calls ----------------------------------------------------

    def start_iteration(self) -> None:
        """``acc.windows(loader)`` began: watch every optimizer's steps until it ends."""
        self._iterations += 1
        if self._any_handle is None:
            # Weakly: an iteration never finished must not keep the model alive.
            ref = weakref.ref(self)

            def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
                guard = ref()
                if guard is not None:
                    guard._before_any_step(optimizer, args, kwargs)

            self._any_handle = register_optimizer_step_pre_hook(hook)

    def end_iteration(self) -> None:
        self._iterations = max(self._iterations - 1, 0)
        if self._iterations == 0 and self._any_handle is not None:
            self._any_handle.remove()
            self._any_handle = None

    def start_window(self, index: int) -> None:
        self.window_open = True
        self.window_index = index
        self._sentinel = self._sentinel_grad = None

    def end_window(self) -> None:
        self.window_open = False
        self._sentinel = self._sentinel_grad = None

    # -- the Watch: the sentinel gradient ----------------------------------------------------

    def before_backward(self, state: WindowState, loss: torch.Tensor, count: Any) -> None:
        if not self.gradients_intact():
            raise RuntimeError(
                self.cleared_message(state.index, "between two window.backward calls")
            )

    def after_backward(self, state: WindowState | None = None) -> None:
        """Remember one gradient produced so far, to notice if something clears it."""
        sentinel = self._sentinel
        if sentinel is None or sentinel.grad is None:
            sentinel = next((p for p in self._params if p.grad is not None), None)
            if sentinel is None:  # e.g. FSDP2 holds unsharded gradients itself until the sync
                return
        grad = sentinel.grad
        self._sentinel, self._sentinel_grad, self._sentinel_version = sentinel, grad, grad._version

    def before_step(self, state: WindowState) -> None:
        if not self.gradients_intact():
            where = "after the last window.backward, before window.step()"
            raise RuntimeError(self.cleared_message(state.index, where))

    def gradients_intact(self) -> bool:
        """False when the remembered gradient was cleared, replaced or modified since."""
        if self._sentinel is None:  # nothing from fullbatch yet: any gradient came from outside
            return all(p.grad is None for p in self._params)
        grad: torch.Tensor | None = self._sentinel.grad
        if grad is None or id(grad) != id(self._sentinel_grad):
            return False
        return bool(grad._version == self._sentinel_version)

    @staticmethod
    def cleared_message(index: int, where: str) -> str:
        return (
            f"the gradients accumulated in window {index} were cleared or changed {where} (a "
            "leftover optimizer.zero_grad(), model.zero_grad(), loss.backward() or "
            "clip_grad_norm_ in the loop?), so the step would not be the full batch's. The "
            "window was discarded and nothing was stepped. Backpropagate only through "
            "window.backward(loss_sum, count); fullbatch clears and clips gradients itself."
        )

    # -- scheduler.step ----------------------------------------------------------------------

    def _scheduler_epoch(self) -> Any:
        return getattr(self._scheduler, "last_epoch", None)

    def scheduler_moved(self) -> bool:
        """The scheduler was stepped since fullbatch last stepped it."""
        return self._scheduler is not None and self._scheduler_epoch() != self._epoch

    def scheduler_stepped(self) -> None:
        self._epoch = self._scheduler_epoch()

    def scheduler_message(self) -> str:
        return (
            f"scheduler.step() was called outside fullbatch (its last_epoch moved from "
            f"{self._epoch} to {self._scheduler_epoch()}), but the scheduler was given to the "
            "Accumulator, which steps it once per optimizer step: the learning rate would "
            "decay twice as fast. Delete your scheduler.step() call, or do not pass "
            "scheduler= to the Accumulator."
        )

    def close(self) -> None:
        self._handle.remove()
        self._dcp.close()
        self.end_window()
        self._iterations = 1
        self.end_iteration()

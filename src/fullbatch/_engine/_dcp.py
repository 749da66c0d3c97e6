"""The optimizer step that ``torch.distributed.checkpoint`` takes itself, told from a stray one.

DCP's ``get_state_dict(model, optimizer)`` and ``set_state_dict(...)`` give an optimizer that
has no state yet one (``_init_optim_state``, torch 2.2-2.13): when no parameter has a
gradient, they set every gradient to zeros and every learning rate to 0, call
``optimizer.step()``, put the learning rates back and clear the gradients. The optimizer then
holds a state (AdamW: step 1, zero moments) with the parameters unchanged, as it does in any
loop that saves with DCP before its first step (every rank does the same).

Inside a window that step is not the user's: refusing it would be wrong, and harmful: an
exception out of ``optimizer.step()`` there leaves every learning rate at 0 and the gradients
at zeros (DCP puts them back only after the step returns). So the loop guard lets it through,
recognised by where it comes from (the function and module above) and by what it is (every
learning rate 0); and checks, after the step, that the parameters did not move (an optimizer
that moves them with a learning rate of 0 would change the run: then it raises, naming DCP).
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

import torch

from fullbatch._base._fingerprint import tensor_sums

__all__ = ["DcpInitStep"]

_MODULE = "torch.distributed.checkpoint.state_dict"
_FUNCTION = "_init_optim_state"
_DEPTH = 8  # frames between optimizer.step()'s pre-hook and its caller: 3 in torch 2.13


def called_by_dcp_init() -> bool:
    """Whether DCP's ``_init_optim_state`` is among the few frames above the caller."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(_DEPTH):
        if frame is None:
            return False
        if frame.f_code.co_name == _FUNCTION and frame.f_globals.get("__name__") == _MODULE:
            return True
        frame = frame.f_back
    return False


class DcpInitStep:
    """Recognises DCP's initialisation step (:meth:`allow`) and checks it after the step.

    Holds no reference to the optimizer (its hooks get it): no reference cycle keeps an
    optimizer, and the process group its state may hold, alive until a garbage collection.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[Any]) -> None:
        self._params = params
        self._before: list[torch.Tensor] | None = None
        self._window = 0
        self._handle = optimizer.register_step_post_hook(self._after_step)

    def allow(self, optimizer: torch.optim.Optimizer, window_index: int) -> bool:
        """True for DCP's zero-learning-rate step (called from the step pre-hook)."""
        groups = optimizer.param_groups
        if not called_by_dcp_init() or any(float(g.get("lr", 0.0)) != 0.0 for g in groups):
            return False
        self._before = [tensor_sums(p) for p in self._params]
        self._window = window_index
        return True

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        before, self._before = self._before, None
        if before is None:
            return
        moved = [
            i
            for i, (p, sums) in enumerate(zip(self._params, before, strict=True))
            if not torch.equal(tensor_sums(p), sums)
        ]
        if moved:
            raise RuntimeError(
                f"torch.distributed.checkpoint's get_state_dict/set_state_dict initialised the "
                f"optimizer's state inside window {self._window} by stepping it with every "
                f"learning rate 0 and zero gradients (_init_optim_state), and this optimizer "
                f"moved {len(moved)} parameter(s) even so: the run no longer matches the full "
                "batch. DCP left the learning rates at 0. Call get_state_dict(model, optimizer) "
                "at a window boundary (after window.step()) or once before the first window, "
                "so that the optimizer has a state before any window opens."
            )

    def close(self) -> None:
        self._handle.remove()
        self._before = None

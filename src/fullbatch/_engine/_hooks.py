"""Window hooks: user functions called once per optimizer step, on the final gradients.

PyTorch's gradient hooks fire per backward call (``Tensor.register_hook``,
``register_post_accumulate_grad_hook``, DDP comm hooks), so under accumulation they see partial,
unnormalized sums, once per micro-batch and once more per extra loss term (ColossalAI #5601).
A window hook fires once per window, at the one point where the gradients are the full
batch's: summed over every micro-batch and backward call, synced over ranks, unscaled and
normalized, before clipping and the optimizer step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from torch.utils.hooks import RemovableHandle

__all__ = ["WindowHooks"]


class WindowHooks:
    """An ordered set of ``fn()`` callables, run in registration order.

    >>> hooks = WindowHooks()
    >>> handle = hooks.register(lambda: print("window done"))
    >>> hooks.run()
    window done
    >>> handle.remove(); hooks.run(); bool(hooks)
    False
    """

    def __init__(self) -> None:
        self._hooks: OrderedDict[int, Callable[[], Any]] = OrderedDict()

    def register(self, fn: Callable[[], Any]) -> RemovableHandle:
        if not callable(fn):
            raise ValueError(
                f"a window hook must be a callable taking no arguments, got {fn!r}; e.g. "
                "acc.register_window_hook(lambda: log_grad_norms(model))."
            )
        handle = RemovableHandle(self._hooks)
        self._hooks[handle.id] = fn
        return handle

    def __bool__(self) -> bool:
        return bool(self._hooks)

    def run(self) -> None:
        for fn in list(self._hooks.values()):
            fn()

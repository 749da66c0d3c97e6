"""The probe's own hooks on the optimizers, and how they all go after the last probed window.

Torch runs an optimizer's step hooks by iterating its hook dictionaries lazily: a hook removed
while ``step()`` runs them would break that loop (``dictionary changed size during
iteration``). So when the last probed window ends inside ``step()``, the hooks go the moment
that step's update is done: torch calls ``optimizer._optimizer_step_code()`` right after it
(a no-op method, the profiler's entry point), and an attribute of that name on the optimizer
removes every hook, itself, and calls the method it stood in for. A global forward pre-hook
does the same at the next forward, in case the step raised before its end; both go together.
Outside ``step()`` (the block ends, a window closes at a forward) everything goes at once.

:func:`after_closure` is where a step pre-hook checks when ``step`` got a closure (Lightning
runs the window's last micro-batch, its clipping and its callbacks inside ``step(closure)``):
right after the closure returns, before the parameters move.

:func:`eager_hook` is how a global forward hook stays out of compiled graphs: a hook traced
inside a compiled call breaks the graph there, and inductor then compiles (and rounds) each
piece apart, so a probed run would differ from an unprobed one (docs/probe.md, "Compiled
models").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn.modules import module as module_hooks
from torch.utils.hooks import RemovableHandle

__all__ = ["Hooks", "after_closure", "eager_hook"]

_AFTER_STEP = "_optimizer_step_code"


class Hooks:
    """Removable handles, removed now or right after the running ``step()``.

    >>> import torch
    >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    >>> hooks = Hooks()
    >>> hooks.add(opt.register_step_pre_hook(lambda o, a, k: hooks.remove_after_step(o)))
    >>> opt.step()
    >>> len(opt._optimizer_step_pre_hooks), "_optimizer_step_code" in vars(opt)
    (0, False)
    """

    def __init__(self) -> None:
        self._handles: list[RemovableHandle] = []
        self._waiting: Any = None  # the optimizer whose step end removes the hooks

    def add(self, handle: RemovableHandle) -> None:
        self._handles.append(handle)

    def remove_all(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._waiting is not None:
            vars(self._waiting).pop(_AFTER_STEP, None)
            self._waiting = None

    def remove_after_step(self, optimizer: Any) -> None:
        """Remove every hook when ``optimizer.step()``, now running its hooks, has updated."""
        if self._waiting is not None:
            return

        def after_step() -> None:
            self.remove_all()
            getattr(optimizer, _AFTER_STEP)()  # the method itself, for a profiler hooked on it

        def at_forward(module: Any, args: Any) -> None:
            self.remove_all()

        hook = eager_hook(at_forward)
        self._handles.append(module_hooks.register_module_forward_pre_hook(hook))
        setattr(optimizer, _AFTER_STEP, after_step)
        self._waiting = optimizer


def after_closure(args: Any, kwargs: Any, check: Callable[[], None]) -> Any:
    """What a step pre-hook returns to run ``check`` now (no closure: returns None) or right
    after the step's closure first returns (the new ``(args, kwargs)``).

    >>> after_closure((), {}, lambda: print("checked"))
    checked
    >>> args, _ = after_closure((lambda: "loss",), {}, lambda: print("checked"))
    >>> args[0]()
    checked
    'loss'
    """
    closure = kwargs.get("closure", args[0] if args else None)
    if not callable(closure):
        check()
        return None
    checked = False

    def closure_then_check() -> Any:
        nonlocal checked
        result = closure()
        if not checked:  # LBFGS calls its closure again: the window is the first call's
            checked = True
            check()
        return result

    if "closure" in kwargs:
        return args, {**kwargs, "closure": closure_then_check}
    return (closure_then_check, *args[1:]), kwargs


def eager_hook(
    hook: Callable[..., Any],
    *,
    compiled: bool = False,
    on_error: Callable[[Exception], None] | None = None,
) -> Callable[..., Any]:
    """``hook`` as a forward (pre-)hook that runs eagerly and never splits a graph it need not.

    Inside a call that dynamo traces, a module whose own call is not compiled as a whole (every
    module inside ``torch.compile(model)``, the modules inside a ``model.compile()``d one) gets
    a no-op that dynamo traces away: its graph is the unprobed one, bitwise. A module whose own
    call is compiled (``model.compile()``: its hooks are inside its graph), or any module with
    ``compiled=True`` (a hook on the one module the probe was given), runs ``hook`` behind
    :func:`torch.compiler.disable`: a graph break at that call's edges only. Eager calls run
    ``hook`` itself. ``on_error(error)``, when given, gets what ``hook`` raises (and may raise
    it again); its return stands for the hook's.

    >>> calls = []
    >>> hook = eager_hook(lambda module, args: calls.append(type(module).__name__))
    >>> hook(torch.nn.Linear(1, 1), ()), calls
    (None, ['Linear'])
    """

    def safe(*args: Any) -> Any:
        try:
            return hook(*args)
        except Exception as error:
            if on_error is None:
                raise
            on_error(error)
            return None

    disabled = torch.compiler.disable(safe)

    def eager(module: Any, *args: Any) -> Any:
        if (
            not compiled
            and torch.compiler.is_compiling()
            and getattr(module, "_compiled_call_impl", None) is None
        ):
            return None  # inside a compiled call: the probe records the compiled module's call
        return disabled(module, *args)

    return eager

"""A model copy that shares nothing with the user's, and a guard that the check changed nothing.

``copy.deepcopy`` copies a module's parameters but not the functions stored on it: a forward
patched onto the instance (TRL's fused LM head, ``model.forward = MethodType(f, model)``) keeps
closing over the *original* model, so the copy would run the user's parameters and leave its
own without gradients. :func:`isolated_copy` rebuilds such functions with their closure copied
through the same memo, so the copy's patched forward calls the copy. :class:`Untouched` then
proves it: the user's parameters, gradients, RNG streams and the Trainer's state are restored
or found unchanged, and a gradient that reached the user's model is an error.
"""

from __future__ import annotations

import copy
import dataclasses
import random
import types
from typing import Any

import torch

__all__ = ["Untouched", "isolated_copy"]


def _rebuilt(method: types.MethodType, owner: Any, memo: dict[int, Any]) -> types.MethodType:
    func = method.__func__
    if not isinstance(func, types.FunctionType) or not func.__closure__:
        return types.MethodType(func, owner)
    cells = []
    for cell in func.__closure__:
        try:
            contents = cell.cell_contents
        except ValueError:  # an empty cell
            cells.append(cell)
            continue
        cells.append(types.CellType(copy.deepcopy(contents, memo)))
    new = types.FunctionType(
        func.__code__, func.__globals__, func.__name__, func.__defaults__, tuple(cells)
    )
    new.__kwdefaults__ = func.__kwdefaults__
    new.__dict__.update(func.__dict__)
    return types.MethodType(new, owner)


def isolated_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model`` whose instance-patched methods call the copy, not ``model``.

    >>> import types
    >>> def patch(module):  # as TRL patches its fused LM head: a closure over the original
    ...     original = module.forward
    ...     module.forward = types.MethodType(lambda self, x: original(x) * 2, module)
    >>> net = torch.nn.Linear(2, 1)
    >>> patch(net)
    >>> twin = isolated_copy(net)
    >>> _ = twin(torch.ones(1, 2)).sum().backward()
    >>> net.weight.grad is None, twin.weight.grad is not None
    (True, True)
    """
    memo: dict[int, Any] = {}
    twin = copy.deepcopy(model, memo)
    for module in twin.modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, types.MethodType):
                setattr(module, name, _rebuilt(value, module, memo))
    if any(id(p) in {id(q) for q in model.parameters()} for p in twin.parameters()):
        raise RuntimeError("the model's copy shares parameters with the model itself")
    return twin


def _plain(value: Any) -> bool:
    """Small Python data a check may mutate in place (metric lists, counters)."""
    if isinstance(value, (str, int, float, bool, type(None))):
        return True
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    if isinstance(value, (list, tuple, set)):
        return all(_plain(v) for v in value)
    return False


class Untouched:
    """Restore RNG streams and the Trainer's attributes on exit; refuse a touched model.

    On exit the user's parameters must be unchanged (their version counters) and their
    gradients the same tensors with the same values; otherwise the gradients are restored and
    ``RuntimeError`` says the check ran the user's model (its result would be void).
    """

    def __init__(self, trainer: Any, model: torch.nn.Module) -> None:
        self.trainer, self.model = trainer, model

    def __enter__(self) -> Untouched:
        params = list(self.model.parameters())
        self.versions = [p._version for p in params]
        self.grads = [p.grad for p in params]
        self.grad_values = [None if g is None else g.detach().clone() for g in self.grads]
        self.rng = (torch.get_rng_state(), random.getstate(), _numpy_state())
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        self.attributes = dict(vars(self.trainer))
        # Contents mutated in place (metric lists, the TrainerState), restored in place so that
        # every object keeps its identity.
        self.contents: list[tuple[Any, Any]] = [
            (value, copy.deepcopy(value))
            for value in self.attributes.values()
            if (isinstance(value, (dict, list)) and _plain(value))
            or (
                dataclasses.is_dataclass(value)
                and not isinstance(value, type)
                and hasattr(value, "__dict__")
            )
        ]
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.set_rng_state(self.rng[0])
        random.setstate(self.rng[1])
        if self.rng[2] is not None:
            import numpy

            numpy.random.set_state(self.rng[2])
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        vars(self.trainer).clear()
        vars(self.trainer).update(self.attributes)
        for value, snapshot in self.contents:
            if isinstance(value, dict):
                value.clear()
                value.update(snapshot)
            elif isinstance(value, list):
                value[:] = snapshot
            else:
                vars(value).update(vars(snapshot))
        params = list(self.model.parameters())
        touched = [
            i
            for i, p in enumerate(params)
            if p.grad is not self.grads[i]
            or (p.grad is not None and not torch.equal(p.grad, self.grad_values[i]))  # type: ignore[arg-type]
        ]
        for i in touched:
            grad, saved = self.grads[i], self.grad_values[i]
            params[i].grad = grad
            if grad is not None and saved is not None:
                grad.copy_(saved)
        changed = [i for i, p in enumerate(params) if p._version != self.versions[i]]
        if (touched or changed) and exc[0] is None:
            raise RuntimeError(
                f"check_trainer ran the model itself, not only its copy ({len(touched)} "
                f"gradients, {len(changed)} parameters of the model were written; gradients "
                "restored): something the framework patched onto the model still calls the "
                "original. The check is void; please report this with the Trainer's class."
            )


def _numpy_state() -> Any:
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy ships with torch's usual installs
        return None
    return numpy.random.get_state()

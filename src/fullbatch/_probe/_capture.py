"""Record every micro-batch the model runs: its inputs, and the RNG and autocast state before it.

A *call* is one forward of the outermost module that runs with gradients enabled (DDP and the
Lightning/Fabric wrappers are looked through: the module inside them is what ran, and the DDP
wrapper is kept for its process group). With no model given, global forward hooks find it;
with one, hooks on that module alone. The hooks only read: the inputs are kept by reference
(containers copied), the RNG state is copied, nothing is written to the model.

**A micro-batch is a call whose output reaches a backward.** Each call's output tensors get a
pre-hook on their ``grad_fn`` that only notes that autograd ran through it (it returns nothing,
so no gradient changes; it is removed when the window is checked). :func:`micro_batches` then
leaves out the calls no backward reached, wherever they ran: a validation loss or a logging
forward computed without ``torch.no_grad()`` is not part of the window. A training
micro-batch whose backward was skipped is left out too; the window's report counts the calls
left out, and a divisor that still counts their items shows as a factor the judge names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as module_hooks
from torch.utils.hooks import RemovableHandle

from fullbatch._base._deepspeed import is_deepspeed_engine
from fullbatch._base._rng import RngState
from fullbatch._base._sync._probe import is_ddp
from fullbatch._probe._frames import find_labels, find_micro, held_together
from fullbatch._probe._hooks import eager_hook

__all__ = ["Call", "Capture", "Reach", "autocast_state", "micro_batches"]

#: Lightning's and Fabric's wrappers, whose forward only hands the inputs to the module inside.
_TRANSPARENT = ("_LightningModuleWrapperBase", "_FabricModule")
_AUTOCAST_DEVICES = ("cpu", "cuda")
#: Output tensors watched per call at most (a model's outputs may hold its whole KV cache).
_MAX_WATCHED = 64


def autocast_state() -> tuple[tuple[str, torch.dtype], ...]:
    """The autocast regions in force: ``(device type, dtype)`` for each enabled one.

    >>> with torch.autocast("cpu", dtype=torch.bfloat16):
    ...     autocast_state()
    (('cpu', torch.bfloat16),)
    """
    return tuple(
        (device, torch.get_autocast_dtype(device))
        for device in _AUTOCAST_DEVICES
        if torch.is_autocast_enabled(device)
    )


class Reach:
    """Whether a backward ran through a call's output: ``yes`` is set by pre-hooks on the
    ``grad_fn`` of its output tensors (see the module docstring); ``task``: autograd's id of
    the first backward that did (two forwards one ``backward()`` ran through share it)."""

    __slots__ = ("handles", "task", "yes")

    def __init__(self) -> None:
        self.yes = False
        self.task: int | None = None
        self.handles: list[RemovableHandle] = []

    def watch(self, output: Any) -> None:
        """Hook the ``grad_fn`` of the tensors in ``output`` (nested containers, once each)."""
        nodes: dict[int, Any] = {}
        for tensor in _tensors(output, 3):
            node = tensor.grad_fn
            if node is not None and id(node) not in nodes:
                nodes[id(node)] = node
                if len(nodes) >= _MAX_WATCHED:
                    break
        self.handles = [node.register_prehook(self._reached) for node in nodes.values()]

    def _reached(self, grad_outputs: Any) -> None:
        if not self.yes:
            self.task = int(torch._C._current_graph_task_id())
        self.yes = True  # returns None: the gradient flows on unchanged

    def release(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def _tensors(value: Any, depth: int) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value] if value.requires_grad else []
    if depth == 0:
        return []
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v, depth - 1)]
    return []


def micro_batches(calls: list[Call]) -> tuple[list[Call], int]:
    """The window's micro-batches among ``calls`` (those whose output reached a backward), and
    how many calls were left out.

    >>> calls = [Call(nn.Linear(1, 1), None, (), {}, None, ()) for _ in range(3)]  # type: ignore
    >>> calls[0].reach.yes = calls[2].reach.yes = True
    >>> kept, left_out = micro_batches(calls)
    >>> [calls.index(c) for c in kept], left_out
    ([0, 2], 1)
    """
    kept = [call for call in calls if call.reach.yes]
    return kept, len(calls) - len(kept)


@dataclass
class Call:
    """One micro-batch as the model ran it.

    Attributes:
        module: the module that ran (wrappers looked through).
        wrapper: the DDP wrapper it ran under, or None.
        args, kwargs: its inputs (tensors by reference).
        rng: the RNG state just before its forward (dropout replays from it).
        autocast: the autocast regions its forward ran in.
        micro: the engine's own micro-batch around the call (the trainer's ``inputs``, a
            Lightning ``batch``, a loop's ``micro``), found by identity of the tensors the model
            received; None when not found.
        targets: a ``labels``/``targets`` tensor found beside the model's input where the
            engine unpacked ``(inputs, targets)`` (Super-Gradients, ``for x, y in loader``);
            the built-in objectives use it when neither the call nor ``micro`` has labels.
        reach: whether a backward ran through the call's output (see :func:`micro_batches`).
        with_previous: the previous call's inputs were still bound beside this call's in the
            loop's frame, no loop value holding either (``for q, k in loader``: ``model(k)``
            runs beside ``q``); :func:`fullbatch._probe._coupled.one_per_micro` reads it.
        early: its gradient taken at its forward (:class:`fullbatch._probe._early.Taken`),
            or None: replayed at ``step()``.
    """

    module: nn.Module
    wrapper: nn.Module | None
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rng: RngState
    autocast: tuple[tuple[str, torch.dtype], ...]
    micro: Any = None
    targets: torch.Tensor | None = None
    reach: Reach = field(default_factory=Reach)
    with_previous: bool = False
    early: Any = None

    def labels(self) -> tuple[torch.Tensor | None, bool]:
        """``(labels, already shifted)`` from the model's inputs (keywords, or a mapping passed
        whole: Composer's ``model(batch)``), the engine's micro-batch, or beside the input."""
        micro = self.micro if isinstance(self.micro, Mapping) else {}
        for source in (self.kwargs, *(a for a in self.args if isinstance(a, Mapping)), micro):
            if isinstance(source.get("shift_labels"), torch.Tensor):
                return source["shift_labels"], True
            if isinstance(source.get("labels"), torch.Tensor):
                return source["labels"], False
        return self.targets, False

    def user_micro(self) -> Any:
        """What an objective ``fn(model, micro)`` receives (docs/probe.md): the engine's
        micro-batch when found (a mapping, list or tuple of the loop holding the model's
        input), else ``(inputs, targets)`` where the loop unpacked the labels beside the input,
        else ``inputs``: what the model received (its one positional input, or its keyword
        inputs as a dict)."""
        if self.micro is not None:
            return self.micro
        inputs = self.inputs()
        return inputs if self.targets is None else (inputs, self.targets)

    def inputs(self) -> Any:
        """What the model received: its one positional input, or its inputs as a dict."""
        if len(self.args) == 1 and not self.kwargs:
            return self.args[0]
        return dict(self.kwargs) if not self.args else {"args": self.args, **self.kwargs}


def _wrapper_kind(module: nn.Module) -> str | None:
    """``"ddp"``, ``"transparent"`` (a wrapper whose forward only hands its inputs on), or None.

    A module with no parameters or buffers of its own whose one child is a DDP wrapper is taken
    as a pass-through around it (ColossalAI's ``TorchDDPModel``: ``forward`` calls
    ``self.module``): the probe must look through it to the model inside, or its own forwards
    would run DDP's (which prepares DDP's reducer for a backward that never comes).
    """
    if is_ddp(module):
        return "ddp"
    # DataParallel and DeepSpeed's engine hand their inputs on too (the engine also hooks its
    # output's backward: replayed through it, the probe's backward would run them).
    if type(module).__name__ in _TRANSPARENT or isinstance(module, nn.DataParallel):
        return "transparent"
    if is_deepspeed_engine(module):
        return "transparent"
    children = list(module.children())
    if (
        len(children) == 1
        and is_ddp(children[0])
        and next(module.parameters(recurse=False), None) is None
        and next(module.buffers(recurse=False), None) is None
    ):
        return "transparent"
    return None


def _inside(module: nn.Module) -> nn.Module:
    """The module a wrapper hands its inputs to."""
    inner = getattr(module, "module", None) or getattr(module, "_forward_module", None)
    return inner if isinstance(inner, nn.Module) else next(module.children())


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (-1: it is not)."""
    return bool(torch._C._current_graph_task_id() != -1)


def _tensor_ids(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> set[int]:
    ids = set()
    for value in (*args, *kwargs.values()):
        ids.add(id(value))
        if isinstance(value, Mapping):
            ids.update(id(v) for v in value.values() if isinstance(v, torch.Tensor))
    return ids


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def _copied(value: Any) -> Any:
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, list):
        return list(value)
    return value


@dataclass
class _Frame:
    kind: str  # "root", "wrapper", "inner"
    module: nn.Module
    rng: RngState | None = None
    autocast: tuple[tuple[str, torch.dtype], ...] = ()
    args: tuple[Any, ...] = ()  # as the caller passed them, before the module's own pre-hooks


@dataclass
class Capture:
    """Forward hooks that append a :class:`Call` per root forward to ``calls``.

    ``on_first(module, wrappers)`` runs at each module's first call of a window (before it is
    recorded), so the gradients present before the window's first backward can be looked at;
    ``on_call(call, output)`` after each call is recorded, with what the model returned (before
    the call's :class:`Reach` hooks go on: a gradient taken there is no backward of the engine).
    ``outer`` holds every outermost module that ran with gradients since the last :meth:`take`
    (the wrappers and the modules inside them), for the window's gradient reader.
    """

    model: nn.Module | None
    on_first: Callable[[nn.Module, tuple[nn.Module, ...]], None]
    on_call: Callable[[Call, Any], None] | None = None
    on_error: Callable[[Exception], None] | None = None  # what a hook raised (None: raise it)
    calls: list[Call] = field(default_factory=list)
    outer: dict[int, nn.Module] = field(default_factory=dict)
    paused: bool = False
    _stack: list[_Frame] = field(default_factory=list)
    _handles: list[RemovableHandle] = field(default_factory=list)
    _firsts: set[int] = field(default_factory=set)  # modules that ran since the last take
    _wrapper: nn.Module | None = None  # an explicit model's DDP wrapper

    def start(self) -> None:
        # Eager (they read frames and RNG state and keep tensors); a global hook never splits
        # a compiled graph (``eager_hook``: a split graph rounds apart from the unprobed one).
        inside = self.model is not None  # a hook on the given module must see its calls
        pre = eager_hook(self._pre, compiled=inside, on_error=self.on_error)
        post_hook = eager_hook(self._post, compiled=inside, on_error=self.on_error)
        if self.model is None:
            try:
                post = module_hooks.register_module_forward_hook(
                    post_hook, with_kwargs=True, always_call=True
                )
            except TypeError as error:  # torch < 2.6: global hooks see no keyword arguments
                raise RuntimeError(
                    f"fb.probe() without a model needs global forward hooks with keyword "
                    f"arguments (torch >= 2.6), this is torch {torch.__version__}; pass the "
                    "model: fb.probe(model, ...)."
                ) from error
            self._handles = [module_hooks.register_module_forward_pre_hook(pre), post]
            return
        target: Any = self.model
        while _wrapper_kind(target) is not None:
            self._wrapper = target if is_ddp(target) else self._wrapper
            target = _inside(target)
        self._handles = [
            target.register_forward_pre_hook(pre),
            target.register_forward_hook(post_hook, with_kwargs=True, always_call=True),
        ]

    def stop(self) -> None:
        for handle in self._handles:
            handle.remove()
        if self.model is None:  # torch's handle leaves this entry behind (torch 2.6 to 2.13)
            for handle in self._handles:
                module_hooks._global_forward_hooks_with_kwargs.pop(handle.id, None)
        self._handles = []
        self._stack.clear()
        for call in self.calls:
            call.reach.release()

    def reached(self) -> bool:
        """Whether a call recorded since the last :meth:`take` has reached a backward."""
        return any(call.reach.yes for call in self.calls)

    def take(self) -> tuple[list[Call], tuple[nn.Module, ...]]:
        """The calls of the window that ends now (their backward watch removed) and the outer
        modules seen; the next window starts empty."""
        calls, self.calls = self.calls, []
        outer, self.outer = tuple(self.outer.values()), {}
        self._firsts = set()
        for call in calls:
            call.reach.release()
        return calls, outer

    def _pre(self, module: nn.Module, args: Any) -> None:
        if self.paused or _in_backward():  # activation checkpointing re-runs forwards there
            return
        outermost = all(frame.kind == "wrapper" for frame in self._stack)
        if not outermost:
            self._stack.append(_Frame("inner", module))
            return
        if torch.is_grad_enabled():
            self.outer.setdefault(id(module), module)
        if _wrapper_kind(module) is not None:
            self._stack.append(_Frame("wrapper", module))
            return
        if not torch.is_grad_enabled():
            self._stack.append(_Frame("inner", module))
            return
        if id(module) not in self._firsts:
            self._firsts.add(id(module))
            self.on_first(module, tuple(f.module for f in self._stack))
        self._stack.append(_Frame("root", module, RngState(), autocast_state(), tuple(args)))

    def _post(self, module: nn.Module, args: Any, *rest: Any) -> None:
        if self.paused or not self._stack or _in_backward():
            return
        frame = self._stack.pop()
        if frame.kind != "root" or len(rest) != 2:  # 1 extra argument: the forward raised
            return
        kwargs, output = rest
        args = frame.args  # a module pre-hook may have replaced them (DeepSpeed ZeRO-3 does)
        assert frame.rng is not None
        ddp = (f.module for f in reversed(self._stack) if is_ddp(f.module))
        wrapper = next(ddp, self._wrapper)
        ids = _tensor_ids(args, kwargs)
        micro = find_micro(ids)
        sources = (kwargs, micro, *args)
        found = any(
            isinstance(v, Mapping) and ("labels" in v or "shift_labels" in v) for v in sources
        )
        inputs = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
        targets = None if found or not inputs else find_labels(inputs)
        call = Call(
            module=module,
            wrapper=wrapper,
            args=tuple(_copied(a) for a in args),
            kwargs=dict(kwargs),
            rng=frame.rng,
            autocast=frame.autocast,
            micro=_copied(micro),
            targets=targets,
        )
        last = self.calls[-1] if self.calls else None
        if last is not None and last.module is module and last.micro is None and micro is None:
            before = {id(v) for v in (*last.args, *last.kwargs.values()) if _is_tensor(v)}
            call.with_previous = bool(before) and held_together(ids, before)
        self.calls.append(call)
        if self.on_call is not None:
            self.on_call(call, output)  # first: its autograd.grad must not look like a backward
        call.reach.watch(output)

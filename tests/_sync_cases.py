"""Counting host synchronizations on a machine without an accelerator: a fake device.

:class:`HostSyncs` is a pair of torch modes (a function mode above autograd, a dispatch mode
below it). Tensors *on the device* are those a test puts there (``h.to_device(model)``,
``h.to_device(batch)``), those created with ``device=`` that device, and everything computed
from them, including gradients and optimizer state. They report ``device == cuda:0``
(``is_cuda``, ``get_device()``), so fullbatch and torch's own Python code take the branches
they take on a GPU: a count tensor is kept, not read; the loss helpers check labels with an
asynchronous device assertion; collective tensors stay where the backend wants them.
Underneath they are ordinary CPU tensors, so every kernel, gloo collective and DDP reducer runs
for real.

What is counted, with the section of the loop it happened in (``h.section(name)``):

- ``read``: a device value reaching the host, i.e. a host synchronization on a GPU:
  ``item``/``float``/``int``/``bool`` (``aten._local_scalar_dense``), ``tolist``, ``numpy``,
  ``.cpu()`` / ``.to("cpu")``, ``torch.equal``, a copy into a host tensor, and ops whose
  output shape depends on the data (``nonzero``, ``masked_select``, boolean indexing,
  ``unique``, ``repeat_interleave`` without ``output_size``, ``bincount``);
- ``h2d``: a host tensor copied to the device: ``.to(device)``, ``torch.tensor(...,
  device=device)``, or a host tensor (not a 0-dim scalar) used in one op with device tensors
  (index tensors: an implicit copy). A blocking copy is also a ``read``: CUDA's
  ``copy_`` synchronizes the stream for it, ``non_blocking=True`` does not.

Not counted: reads of host tensors (AdamW's step counters, tensors fullbatch builds from Python
numbers, a loader's CPU tensors) and device factories (``torch.zeros(..., device=d)``).
A factory without ``device=`` called from Python is a host tensor; one made inside an op
(autograd, the DDP reducer's buckets) is a device tensor.

Calibration (``tests/engine/test_host_syncs.py``): a hand-written loop reads 0 times per
window, a ``loss.item()`` per micro-batch is counted per micro-batch, a host tensor's
``tolist()`` is not.
"""

from __future__ import annotations

import contextlib
import traceback
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

import fullbatch as fb

DEVICE = torch.device("cuda", 0)
_PACKAGE = Path(fb.__file__).resolve().parent
_TORCH = Path(torch.__file__).resolve().parent

aten = torch.ops.aten
# A Python value from a device tensor.
_READS = {
    aten._local_scalar_dense,
    aten.equal,
    aten.is_nonzero,
    aten.allclose,
    # output shapes that depend on the data
    aten.nonzero,
    aten.masked_select,
    aten.unique_consecutive,
    aten._unique,
    aten._unique2,
    aten.unique_dim,
    aten.bincount,
}
_BOOL_INDEXED = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
_HOST_READERS = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__array__}
_COPYING = {torch.tensor, torch.as_tensor, torch.asarray, torch.Tensor.new_tensor}


def _is_tensor(t: Any) -> bool:
    return isinstance(t, torch.Tensor)


def _is_device(device: Any) -> bool:
    return device is not None and torch.device(device).type == "cuda"


class HostSyncs:
    """Count reads of device values and host-to-device copies (see the module docstring).

    >>> h = HostSyncs()
    >>> with h:
    ...     x = h.to_device(torch.ones(3))
    ...     y = (x * 2).sum()
    ...     _ = torch.ones(2).tolist()      # a host tensor: not counted
    ...     _ = float(y)                    # a device value: counted
    >>> str(x.device), h.count("read")
    ('cpu', 1)
    """

    def __init__(self) -> None:
        self._device: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.events: list[tuple[str, str, str, str]] = []  # (section, kind, what, where)
        self.section_name = "other"
        self.quiet = 0  # > 0: the harness's own ops (neither counted nor marked)
        self.factory_on_device: bool | None = None  # None: made inside an op -> device
        self._modes = (_Functions(self), _Dispatch(self))

    # -- the device --------------------------------------------------------------------------

    def on_device(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t in self._device

    def mark(self, t: torch.Tensor, on: bool = True) -> torch.Tensor:
        if on:
            self._device[t] = True
        elif t in self._device:
            del self._device[t]
        return t

    def to_device(self, obj: Any) -> Any:
        """Put ``obj`` on the device: a module's parameters and buffers (in place), or a copy
        of a tensor or of every tensor in a container (what ``.to("cuda")`` of loader data
        gives; not counted)."""
        if isinstance(obj, nn.Module):
            for t in list(obj.parameters()) + list(obj.buffers()):
                self.mark(t)
            return obj
        with self.quietly():
            return tree_map(lambda t: self.mark(t.clone()) if _is_tensor(t) else t, obj)

    # -- counting ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def quietly(self) -> Iterator[None]:
        self.quiet += 1
        try:
            yield
        finally:
            self.quiet -= 1

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        saved, self.section_name = self.section_name, name
        try:
            yield
        finally:
            self.section_name = saved

    def record(self, kind: str, what: str) -> None:
        self.events.append((self.section_name, kind, what, _where()))

    def count(self, kind: str, section: str | None = None) -> int:
        return sum(1 for s, k, _, _ in self.events if k == kind and section in (None, s))

    def by_section(self, kind: str = "read") -> Counter[str]:
        return Counter(s for s, k, _, _ in self.events if k == kind)

    def show(self, kind: str = "read", section: str | None = None) -> str:
        """The counted events, one per line: what, and the innermost line of fullbatch."""
        rows = [
            f"  [{s}] {w} at {where}"
            for s, k, w, where in self.events
            if k == kind and section in (None, s)
        ]
        return "\n".join(rows) or "  (none)"

    def reset(self) -> None:
        self.events.clear()

    def _grouped(self, tensorlistlist: Any, *args: Any, **kwargs: Any) -> Any:
        """``torch._C._group_tensors_by_device_and_dtype`` with the device keys as reported
        (optimizers and ``clip_grad_norm_`` move results to the group's device)."""
        groups = self._group(tensorlistlist, *args, **kwargs)
        out = {}
        for (device, dtype), value in groups.items():
            firsts = [t for t in value[0][0] if t is not None] if value[0] else []
            out[(DEVICE if firsts and self.on_device(firsts[0]) else device, dtype)] = value
        return out

    def __enter__(self) -> HostSyncs:
        self._group = torch._C._group_tensors_by_device_and_dtype
        torch._C._group_tensors_by_device_and_dtype = self._grouped
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        torch._C._group_tensors_by_device_and_dtype = self._group


def _where() -> str:
    """The innermost frame of fullbatch (else of the test) that led here."""
    frames = traceback.extract_stack()[:-3]
    for frame in reversed(frames):
        path = Path(frame.filename).resolve()
        if path.is_relative_to(_PACKAGE):
            return f"fullbatch/{path.relative_to(_PACKAGE)}:{frame.lineno} ({frame.line})"
    for frame in reversed(frames):
        path = Path(frame.filename).resolve()
        if not path.is_relative_to(_TORCH) and path.name != Path(__file__).name:
            return f"{path.name}:{frame.lineno} ({frame.line})"
    return "?"


def _tensors(args: Any, kwargs: Any) -> list[torch.Tensor]:
    flat, _ = tree_flatten((args, kwargs))
    return [a for a in flat if isinstance(a, torch.Tensor)]


class _Functions(TorchFunctionMode):
    """The Python view: devices reported, explicit moves and host readers counted."""

    def __init__(self, h: HostSyncs) -> None:
        super().__init__()
        self.h = h

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        h = self.h
        if h.quiet:
            return func(*args, **kwargs)
        if getattr(func, "__name__", "") == "__get__":
            return self._get(func, args)
        if func is torch.Tensor.get_device:
            return 0 if h.on_device(args[0]) else func(*args, **kwargs)
        if func in _HOST_READERS:
            if h.on_device(args[0]):
                h.record("read", func.__name__)
            with h.quietly():
                return func(*args, **kwargs)
        if func is torch.Tensor.to:
            return self._to(args, kwargs)
        if func is torch.Tensor.cpu:
            return self._move(args[0], False, None, False)
        if func is torch.Tensor.cuda:
            return self._move(args[0], True, None, bool(kwargs.get("non_blocking")))
        if kwargs.get("device") is not None:
            return self._factory(func, args, kwargs)
        host_made = not _tensors(args, kwargs)  # torch.zeros(3) from Python: a host tensor
        saved = h.factory_on_device
        h.factory_on_device = False if host_made else None
        try:
            return func(*args, **kwargs)
        finally:
            h.factory_on_device = saved

    def _get(self, func: Any, args: Any) -> Any:
        h = self.h
        owner = args[0]
        name = getattr(getattr(func, "__self__", None), "__name__", "")
        on = h.on_device(owner)
        if name == "device":
            return DEVICE if on else func(*args)
        if name == "is_cuda":
            return on or func(*args)
        if name == "is_cpu":
            return not on and func(*args)
        out = func(*args)
        if on and isinstance(out, torch.Tensor):  # .grad, .data, .T of a device tensor
            h.mark(out)
        return out

    def _factory(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        h = self.h
        on = _is_device(kwargs["device"])
        kwargs["device"] = "cpu"
        data = list(args[:1]) + ([kwargs["data"]] if "data" in kwargs else [])
        if func is torch.Tensor.new_tensor:
            data = list(args[1:2])
        if on and func in _COPYING and not any(h.on_device(t) for t in _tensors(data, {})):
            h.record("h2d", f"{getattr(func, '__name__', func)}(device=)")
            h.record("read", f"blocking copy: {getattr(func, '__name__', func)}(device=)")
        saved = h.factory_on_device
        h.factory_on_device = on
        try:
            out = func(*args, **kwargs)
        finally:
            h.factory_on_device = saved
        for t in _tensors(out, {}):
            h.mark(t, on)
        return out

    def _to(self, args: Any, kwargs: dict[str, Any]) -> Any:
        h = self.h
        t, rest = args[0], args[1:]
        others = [a for a in list(rest) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
        if others:
            other = others[0]
            return self._move(
                t, h.on_device(other), other.dtype, bool(kwargs.get("non_blocking")), kwargs
            )
        parse = {k: v for k, v in kwargs.items() if k != "copy"}
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*rest, **parse)
        on = h.on_device(t) if device is None else _is_device(device)
        return self._move(t, on, dtype, non_blocking, kwargs)

    def _move(
        self,
        t: torch.Tensor,
        to_device: bool,
        dtype: torch.dtype | None,
        non_blocking: bool,
        kwargs: dict[str, Any] | None = None,
    ) -> torch.Tensor:
        h = self.h
        kwargs = kwargs or {}
        on = h.on_device(t)
        copy = bool(kwargs.get("copy", False))
        fmt = kwargs.get("memory_format", torch.preserve_format)
        if on == to_device:
            if dtype is None and not copy:
                return t
            return t.to(dtype=dtype or t.dtype, copy=copy, memory_format=fmt)
        if on:  # device -> host: the host waits for the device
            h.record("read", "to(host)")
        else:
            h.record("h2d", "to(device)" + (", non_blocking" if non_blocking else ""))
            if not non_blocking:
                h.record("read", "blocking copy: to(device)")
        with h.quietly():
            out = t.to(dtype=dtype or t.dtype, copy=True, memory_format=fmt)
        return h.mark(out, to_device)


class _Dispatch(TorchDispatchMode):
    """The kernel view: reads, implicit copies, and which results live on the device."""

    def __init__(self, h: HostSyncs) -> None:
        super().__init__()
        self.h = h

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        h = self.h
        if h.quiet:
            return func(*args, **kwargs)
        tensors = _tensors(args, kwargs)
        on = [t for t in tensors if h.on_device(t)]
        packet = func.overloadpacket
        mutable = func._schema.is_mutable
        if on:
            if packet in _READS or _data_dependent(func, args, kwargs):
                h.record("read", str(packet))
            elif (
                mutable and args and isinstance(args[0], torch.Tensor) and not h.on_device(args[0])
            ):
                h.record("read", f"{packet} into a host tensor")
            else:
                for t in tensors:  # a 0-dim host tensor is a scalar argument, not a copy
                    if not h.on_device(t) and t.dim() > 0:
                        h.record("h2d", f"host tensor in {packet}")
                        h.record("read", f"blocking copy: host tensor in {packet}")
        out = func(*args, **kwargs)
        if mutable and args and isinstance(args[0], torch.Tensor):
            device = h.on_device(args[0])  # in place: the result is where self lives
        elif tensors:
            device = bool(on)
        else:  # a factory: from Python (host unless device=) or inside an op (device)
            device = h.factory_on_device is not False
        if device:
            for t in _tensors(out, {}):
                h.mark(t)
        return out


def _data_dependent(func: Any, args: Any, kwargs: Any) -> bool:
    packet = func.overloadpacket
    if packet is aten.repeat_interleave:
        return kwargs.get("output_size") is None and len(args) < 4
    if packet in _BOOL_INDEXED and len(args) > 1:
        return any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
            for i in args[1]
            if i is not None
        )
    return False


# -- a model, data, and the loop counted by section --------------------------------------------


class TinyLM(nn.Module):
    """Embedding, a tanh layer and a head: a causal LM in three parameters."""

    def __init__(self, vocab: int = 32, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.hidden = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(self.embed(ids))))


def lm_data(
    n: int, rows: int = 2, length: int = 6, seed: int = 0, pad: bool = True
) -> list[dict[str, torch.Tensor]]:
    """``n`` micro-batches of ``rows`` rows: input_ids, attention_mask (right padding) and
    labels with -100 on padding."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(1, 32, (rows, length), generator=g)
        lengths = torch.randint(2 if pad else length, length + 1, (rows,), generator=g)
        mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
        ids = ids * mask
        labels = ids.masked_fill(mask == 0, -100)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def count_windows(
    h: HostSyncs, acc: fb.Accumulator, loader: Any, loss: Any, *, share: str | None = None
) -> list[dict[str, Any]]:
    """Run the plain loop; per window the reads in each section and per micro-batch.

    Sections: ``open`` (``acc.windows`` handing out the window), ``micro`` (``next()`` on the
    window, the user's forward and loss, ``window.backward``), ``step``.
    """
    out = []
    windows = iter(acc.windows(loader))
    while True:
        h.reset()
        with h.section("open"):
            window = next(windows, None)
        if window is None:
            return out
        opened = h.count("read")
        per_micro: list[int] = []
        copies: list[int] = []
        micros = iter(window)
        while True:
            before, copied = h.count("read"), h.count("h2d")
            with h.section("micro"):
                micro = next(micros, None)
                if micro is None:
                    break
                loss_sum, n = loss(micro)
                if share is None:
                    window.backward(loss_sum, n)
                else:
                    window.backward(loss_sum / window.totals[share])
            per_micro.append(h.count("read") - before)
            copies.append(h.count("h2d") - copied)
        with h.section("step"):
            window.step()
        out.append(
            {
                "open": opened,
                "micro": per_micro,
                "h2d": copies,
                "step": h.count("read", "step"),
                "window": h.count("read"),
                "events": h.show(),
            }
        )

"""The pieces of a checkpoint: what identifies a setup, its data and its window.

Pure functions of values and services (an :class:`Engine`, a :class:`WindowState`, a state
dict); :mod:`fullbatch._engine._resume` puts them together for ``acc.state_dict()`` and
``acc.load_state_dict()``, and :func:`fullbatch._engine._open.open_window` restores a window.

The data a state expects is identified by :func:`item_key`: the fingerprint of the loader item
at ``loader_items`` (the interrupted window's first item, or the next window's), ``"end"`` when
the loader had no item left there. A resumed loader whose first item differs is refused. The
model and the optimizer a state expects are identified by :func:`fingerprints`: integer sums of
each trained parameter and of its optimizer state (:mod:`fullbatch._engine._resume_check`
compares them).
"""

from __future__ import annotations

import struct
import zlib
from typing import Any

import torch

from fullbatch._base._fingerprint import fingerprint, tensor_sums
from fullbatch._base._rng import RngState
from fullbatch._engine._batchnorm import _Moments
from fullbatch._engine._core import Engine
from fullbatch._engine._feed import Feed
from fullbatch._engine._state import WindowState

__all__ = [
    "AT_END",
    "AT_ITEM",
    "OTHER_ITEM",
    "PAST_END",
    "check_grads",
    "check_length",
    "fingerprints",
    "identity",
    "item_key",
    "optimizer_progress",
    "param_names",
    "position",
    "restore_window",
    "window_dict",
]


def param_names(engine: Engine) -> list[str]:
    names = {id(p): n for n, p in engine.model.named_parameters()}
    return [names.get(id(p), f"<optimizer param {i}>") for i, p in enumerate(engine.params)]


def identity(engine: Engine, names: list[str]) -> dict[str, Any]:
    """What a state must share with the Accumulator that loads it."""
    return {
        "mode": engine.micro_plan.mode,
        "window_size": engine.micro_plan.checkpoint_size,
        "sync": engine.sync.kind,
        "reduce_at_step": engine.sync.reduce_at_step,  # DDP's ddp_sync="step"
        "world_size": engine.sync.world,
        "rank": engine.sync.rank,
        "batchnorm": "window" if engine.batchnorm is not None else None,
        "params": list(names),
        "shapes": [list(p.shape) for p in engine.params],
    }


def optimizer_progress(optimizer: torch.optim.Optimizer) -> list[float]:
    """``[parameters with optimizer state, their largest step count]`` (-1: no step count).

    A fresh optimizer has ``[0, -1]``; after ``n`` Adam steps on 2 parameters ``[2, n]``.
    """
    states = [s for s in optimizer.state.values() if s]
    steps = [float(s["step"]) for s in states if "step" in s]
    return [float(len(states)), max(steps) if steps else -1.0]


# -- the model and the optimizer: which parameters and optimizer state a state expects -------

_MASK = (1 << 64) - 1


def fingerprints(engine: Engine) -> dict[str, torch.Tensor]:
    """``{"model": [n, 2], "optimizer": [n, 2]}`` int64: per trained parameter, the
    :func:`tensor_sums` of the parameter (FSDP2: this rank's shard) and of its optimizer state
    (every entry, by key). A few reductions per tensor where it lives, one host copy each.

    >>> import fullbatch as fb
    >>> model = torch.nn.Linear(2, 1)
    >>> acc = fb.Accumulator(model, torch.optim.SGD(model.parameters()), micro_batches=2)
    >>> {k: tuple(v.shape) for k, v in fingerprints(acc._engine).items()}
    {'model': (2, 2), 'optimizer': (2, 2)}
    """
    params = engine.params
    model = _to_host([tensor_sums(p) for p in params])
    entries: list[tuple[int, str, Any]] = []
    for i, p in enumerate(params):
        state = engine.optimizer.state.get(p) or {}
        entries.extend((i, str(key), state[key]) for key in sorted(state, key=str))
    tensors = [v for _, _, v in entries if isinstance(v, torch.Tensor)]
    sums = iter(_to_host([tensor_sums(v) for v in tensors]))
    rows = [[0, 0] for _ in params]
    for i, key, value in entries:
        pair = next(sums) if isinstance(value, torch.Tensor) else _number_sums(value)
        salt = zlib.crc32(key.encode())
        rows[i] = [
            (h * 1_000_003 + salt + int(x)) & _MASK for h, x in zip(rows[i], pair, strict=True)
        ]
    signed = [[x - (1 << 64) if x >> 63 else x for x in row] for row in rows]
    optimizer = torch.tensor(signed, dtype=torch.int64).reshape(len(params), 2)
    return {
        "model": torch.tensor(model, dtype=torch.int64).reshape(len(params), 2),
        "optimizer": optimizer,
    }


def _to_host(pairs: list[torch.Tensor]) -> list[list[int]]:
    """Many 2-element tensors as lists of ints: one stack and one copy per device."""
    out: list[list[int]] = [[] for _ in pairs]
    devices: dict[torch.device, list[int]] = {}
    for i, t in enumerate(pairs):
        devices.setdefault(t.device, []).append(i)
    for indices in devices.values():
        host = torch.stack([pairs[i] for i in indices]).cpu().tolist()
        for i, row in zip(indices, host, strict=True):
            out[i] = row
    return out


def _number_sums(value: Any) -> list[int]:
    """A non-tensor optimizer state entry (a step count, a flag) as two integers."""
    if isinstance(value, bool | int | float):
        bits = struct.unpack("<q", struct.pack("<d", float(value)))[0]
        return [bits, bits]
    code = zlib.crc32(repr(value).encode())
    return [code, code]


# -- the data: which loader item a state expects next ----------------------------------------


def item_key(item: Any) -> str:
    """The fingerprint of a loader item, ``"end"`` for none (the loader had ended)."""
    return "end" if item is None else fingerprint(item)


# Where a resumed loader stands, from its first item and the state's next_item (its code in
# the window-start exchange): at the item the state expects (or unknown), past the end the
# state saw, at its end while the state expects an item, at another item.
AT_ITEM, PAST_END, AT_END, OTHER_ITEM = range(4)


def position(pending: dict[str, Any], first_item: Any) -> int:
    """Where a resumed window's first item stands against the item the state expects.

    >>> position({"next_item": "end"}, None), position({"next_item": "end"}, 1)
    (0, 1)
    """
    expected, got = pending.get("next_item"), item_key(first_item)
    if expected is None or got == expected:
        return AT_ITEM
    if expected == "end":
        return PAST_END
    return AT_END if got == "end" else OTHER_ITEM


# -- the window ------------------------------------------------------------------------------


def window_dict(engine: Engine, names: list[str], state: WindowState) -> dict[str, Any]:
    """``state.to_dict()`` plus what the services hold for it: gradients, BatchNorm moments."""
    grads, layouts = {}, {}
    for name, p in zip(names, engine.params, strict=True):
        if p.grad is not None:
            grads[name] = _local(p.grad).detach().clone()
            layouts[name] = _placements(p.grad)
    return {
        **state.to_dict(),
        "grads": grads,
        "grad_layouts": layouts,
        "batchnorm": _batchnorm_dict(engine),
    }


def _batchnorm_dict(engine: Engine) -> dict[str, Any] | None:
    bn = engine.batchnorm
    if bn is None:
        return None
    moments = {
        name: [m.n, m.mean.clone(), m.m2.clone()]
        for name, m in bn._moments.items()
        if m.mean is not None and m.m2 is not None
    }
    saved = {name: [t.clone() for t in ts] for name, ts in bn._saved.items()}
    return {"saved": saved, "moments": moments}


def check_length(saved: dict[str, Any], feed: Feed) -> None:
    """Refuse a resumed window shorter than the micro-batches the state has done."""
    done, have = int(saved["micro_batches_done"]), feed.remaining()
    if have < done:
        raise RuntimeError(
            f"the resumed window has only {have} micro-batch(es) but the state was taken "
            f"after {done}: the loader does not start at state['loader_items'] or "
            "yields different items. Give acc.windows() the loader from that item on."
        )


def restore_window(engine: Engine, state: WindowState, pending: dict[str, Any]) -> WindowState:
    """The window a loaded state was taken in, opened again: skip (read, do not run) the
    micro-batches done, put back their gradients, sums and counts, then the RNG state."""
    saved = pending["window"]
    if saved is not None:
        check_length(saved, state.feed)
        for _ in range(int(saved["micro_batches_done"])):
            state.feed.pop()
        state = WindowState.from_dict(saved, state)
        grads = saved["grads"]
        for name, p in zip(param_names(engine), engine.params, strict=True):
            if name in grads:
                p.grad = _as_grad(grads[name], p)
        bn = engine.batchnorm
        if bn is not None and saved["batchnorm"] is not None:
            bn._saved = {n: tuple(ts) for n, ts in saved["batchnorm"]["saved"].items()}
            bn._moments = {}
            for name, (n, mean, m2) in saved["batchnorm"]["moments"].items():
                moments = _Moments()
                moments.n, moments.mean, moments.m2 = float(n), mean, m2
                bn._moments[name] = moments
        engine.guard.after_backward()  # the restored gradients are fullbatch's own
    RngState.restore_dict(pending["rng"])
    return state


def check_grads(engine: Engine, names: list[str], window: dict[str, Any]) -> None:
    """Refuse saved gradients of another shape, dtype or sharding (``ValueError``)."""
    for name, p in zip(names, engine.params, strict=True):
        if name not in window["grads"]:
            continue
        grad = window["grads"][name]
        want = _local(p.detach())
        layout = window["grad_layouts"][name]
        if tuple(grad.shape) != tuple(want.shape) or grad.dtype != want.dtype:
            raise ValueError(
                f"the saved gradient of {name} has shape {tuple(grad.shape)} and dtype "
                f"{grad.dtype}; this rank's parameter has {tuple(want.shape)}, {want.dtype}."
            )
        if layout != _placements(p.detach()):
            raise ValueError(
                f"the saved gradient of {name} was sharded as {layout!r} (mesh size: "
                f"placements); this model's parameter is {_placements(p.detach())!r}. Shard "
                "the model the same way before loading."
            )


def _placements(t: torch.Tensor) -> str:
    """A DTensor's mesh size and placements, as text ("" for a plain tensor)."""
    mesh = getattr(t, "device_mesh", None)
    if mesh is None:
        return ""
    placements: Any = getattr(t, "placements", ())
    return f"{mesh.size()}:{tuple(placements)}"


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def _as_grad(local: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A saved (local) gradient as ``p``'s gradient: a DTensor shard like ``p``'s, or as is."""
    local = local.to(_local(p.detach()).device)
    mesh = getattr(p, "device_mesh", None)
    if mesh is None:
        return local
    # type(p) is DTensor: taken from the parameter, so that only _sync.py imports
    # torch.distributed.
    dtensor: Any = type(p.detach())
    placements: Any = getattr(p, "placements", ())
    return dtensor.from_local(local, mesh, placements, shape=p.shape, stride=p.stride())

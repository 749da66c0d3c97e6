"""Checkpoint and resume, at a window boundary or between two micro-batches of a window.

What a resumed run needs beyond the model, optimizer, scaler and scheduler states:

- the window so far: gradients, the detached loss sums and counts (summed at the step), ``c``,
  the number of micro-batches done, and the BatchNorm window bookkeeping;
- where the data stands: ``loader_items``, the loader items consumed before the interrupted
  window began. The resumed loader starts there; the window is rebuilt from the same items,
  and the micro-batches already accumulated are read and skipped, not run;
- the RNG state (CPU, and CUDA when initialized), restored just before the first micro-batch
  the resumed run computes, so building fresh objects in between changes nothing;
- the counters ``steps`` and ``skipped_windows``.

The position inside the window is the Accumulator's current window: a state taken after a
micro-batch's ``window.backward`` resumes after that micro-batch. Taken while a micro-batch is
handed out but before its backward, the state would lose it: that raises. A state is a dict of
tensors, numbers, strings and lists (``torch.load(weights_only=True)`` reads it); each rank
saves its own. FSDP2 gradients are DTensor shards: each rank saves its local shard, and loading
checks the mesh size and placements; with ``fsdp_sync="window"`` FSDP2 holds the window's
unsharded gradients itself, so a state inside such a window raises (``"micro_batch"`` works).
A state from another world size, rank, model (parameter names and shapes), sync kind, window
mode or ``batchnorm=`` is refused with ``ValueError`` before anything changes. Restored
gradients re-arm the loop guard's sentinel: they are fullbatch's own, not a stray backward.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from fullbatch._engine._batchnorm import _Moments
from fullbatch._engine._core import Engine
from fullbatch._engine._state import WindowState
from fullbatch._engine._step import abandon_window

__all__ = ["Resume"]

FORMAT = 1


class _Counted:
    """The loader, counting the items taken from it."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader
        self.taken = 0

    def __iter__(self) -> Iterator[Any]:
        for item in self._loader:
            self.taken += 1
            yield item


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


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


class Resume:
    """The Accumulator's checkpoint bookkeeping: the current window and the loader position."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        names = {id(p): n for n, p in engine.model.named_parameters()}
        self._names = [
            names.get(id(p), f"<optimizer param {i}>") for i, p in enumerate(engine.params)
        ]
        self._counted: _Counted | None = None
        self._base = 0  # loader_items the current acc.windows(loader) started at
        self._window: WindowState | None = None
        self._window_start = 0
        self._pending: dict[str, Any] | None = None  # a loaded state, applied at the next window

    # -- hooks called by the Accumulator -----------------------------------------------------

    def count(self, loader: Any) -> _Counted:
        """Wrap the loader of a new ``acc.windows(loader)``: it starts at the loaded position."""
        pending = self._pending
        self._base = pending["loader_items"] if pending is not None else 0
        if pending is not None:
            guard = self._engine.guard
            epoch = guard._scheduler_epoch()
            if epoch != pending["scheduler_epoch"]:
                raise RuntimeError(
                    f"the scheduler's last_epoch is {epoch} but was {pending['scheduler_epoch']} "
                    "when the state was saved: load the scheduler's state_dict too "
                    "(scheduler.load_state_dict(...)) before acc.windows(loader)."
                )
            guard.scheduler_stepped()  # loading the scheduler's state moved it, not the user
        self._counted = _Counted(loader)
        self._window = None
        return self._counted

    def taken(self) -> int:
        return self._base + (self._counted.taken if self._counted is not None else 0)

    def begin(self, window: WindowState, start: int) -> None:
        """A window was built from the items after ``start``: restore a pending state into it."""
        self._window, self._window_start = window, start
        pending, self._pending = self._pending, None
        if pending is None:
            return
        saved = pending["window"]
        if saved is not None:
            self._restore_window(window, saved)
        _set_rng_state(pending["rng"])

    # -- state_dict --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        engine = self._engine
        if self._pending is not None:  # loaded, not resumed yet: still the loaded state
            return dict(self._pending)
        window = self._window if self._window is not None and not self._window.closed else None
        inside = window is not None and window.yielded > 0
        if window is not None and inside:
            self._check_safe(window)
        return {
            "format": FORMAT,
            **self._identity(),
            "steps": engine.steps,
            "skipped_windows": engine.skipped_windows,
            "loss_scale": engine.loss_scale,
            "scheduler_epoch": engine.guard._scheduler_epoch(),
            "loader_items": self._window_start if window is not None else self.taken(),
            "rng": _rng_state(),
            "window": self._window_state(window) if window is not None and inside else None,
        }

    def _check_safe(self, window: WindowState) -> None:
        """Raise where a state would lose work: a micro-batch without its backward yet, or
        gradients FSDP2 holds itself."""
        if window.current_backwards == 0:
            raise RuntimeError(
                f"acc.state_dict() while micro-batch {window.yielded - 1} of window "
                f"{window.index} is handed out but has no backward yet: it would be lost on "
                "resume. Take the state after window.backward(loss_sum, n), at the end of the "
                "loop body."
            )
        engine = self._engine
        if engine.auto is not None or engine.precision is not None:
            what = "an 'auto' size" if engine.auto is not None else "accumulate_dtype"
            raise RuntimeError(
                f"acc.state_dict() inside window {window.index} with {what}: the window's "
                "state (the size it runs with, or the float32 gradient buffers) is not part of "
                "a state yet. Take the state at a window boundary (after window.step())."
            )
        sync = engine.sync
        fsdp_window = sync.kind == "fsdp2" and getattr(sync, "mode", "") == "window"
        if fsdp_window and not window.final_backward:
            raise RuntimeError(
                f"acc.state_dict() inside window {window.index} with FSDP2 and "
                "fsdp_sync='window': FSDP2 holds the window's unsharded gradients itself until "
                "the last micro-batch, out of a state's reach. Build the Accumulator with "
                "fsdp_sync='micro_batch' (each micro-batch's gradient is reduce-scattered into "
                "the sharded .grad, which the state holds), or take the state at a window "
                "boundary (after window.step())."
            )

    def _identity(self) -> dict[str, Any]:
        engine = self._engine
        return {
            "mode": _mode(engine),
            "window_size": engine.micro_batches
            or engine.micro_batch_size
            or engine.micro_batch_tokens
            or "auto",
            "sync": engine.sync.kind,
            "world_size": engine.sync.world,
            "rank": engine.sync.rank,
            "batchnorm": "window" if engine.batchnorm is not None else None,
            "params": list(self._names),
            "shapes": [list(p.shape) for p in engine.params],
        }

    def _window_state(self, window: WindowState) -> dict[str, Any]:
        engine = self._engine
        grads = {}
        layouts = {}
        for name, p in zip(self._names, engine.params, strict=True):
            if p.grad is not None:
                grads[name] = _local(p.grad).detach().clone()
                layouts[name] = _placements(p.grad)
        return {
            "micro_batches_done": window.yielded,
            "loss_scale": window.loss_scale,
            "backwards": window.backwards,
            "form": window.form,
            "final_backward": window.final_backward,
            "losses": [t.clone() for t in window.losses],
            "count": window.count_py,
            "device_counts": [t.clone() for t in window.device_counts],
            "grads": grads,
            "grad_layouts": layouts,
            "batchnorm": self._batchnorm_state(),
        }

    def _batchnorm_state(self) -> dict[str, Any] | None:
        bn = self._engine.batchnorm
        if bn is None:
            return None
        moments = {
            name: [m.n, m.mean.clone(), m.m2.clone()]
            for name, m in bn._moments.items()
            if m.mean is not None and m.m2 is not None
        }
        saved = {name: [t.clone() for t in ts] for name, ts in bn._saved.items()}
        return {"saved": saved, "moments": moments}

    # -- load_state_dict ---------------------------------------------------------------------

    def load_state_dict(self, state: dict[str, Any]) -> None:
        engine = self._engine
        if self._window is not None and not self._window.closed:
            raise RuntimeError(
                f"acc.load_state_dict() while window {self._window.index} is open: load the "
                "state before acc.windows(loader), on a fresh Accumulator or between windows."
            )
        self._check(state)
        engine.steps = int(state["steps"])
        engine.skipped_windows = int(state["skipped_windows"])
        engine.loss_scale = None if state["loss_scale"] is None else float(state["loss_scale"])
        self._pending = dict(state)
        self._window = None

    def _check(self, state: Any) -> None:
        """Every check before anything changes: a refused state leaves the Accumulator as it was."""
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise ValueError(
                "not a fullbatch Accumulator state (expected a dict from acc.state_dict() with "
                f"format={FORMAT}); got {type(state).__name__}"
                + (f" with format={state.get('format')!r}" if isinstance(state, dict) else "")
                + "."
            )
        mine = self._identity()
        for key in ("world_size", "rank", "sync", "mode", "window_size", "batchnorm"):
            if state.get(key) != mine[key]:
                raise ValueError(
                    f"this state was saved with {key}={state.get(key)!r}, but this Accumulator "
                    f"has {key}={mine[key]!r}; a window's gradients and position only make sense "
                    "in the same setup. Resume with the same world size (each rank loads its own "
                    "state), wrapper, micro_batches / micro_batch_size and batchnorm= as the run "
                    "that saved it."
                )
        if state.get("params") != mine["params"] or state.get("shapes") != mine["shapes"]:
            diff = _first_difference(state, mine)
            raise ValueError(
                f"this state was saved for another model: {diff}. Build the same model (same "
                "parameter names and shapes, same optimizer parameters) before loading it."
            )
        window = state.get("window")
        if window is None:
            return
        for name, p in zip(self._names, self._engine.params, strict=True):
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

    def _restore_window(self, window: WindowState, saved: dict[str, Any]) -> None:
        """Skip the micro-batches done, then put back their gradients, sums and counts."""
        engine = self._engine
        done = int(saved["micro_batches_done"])
        for i in range(done):
            if window.feed.pop() is None:
                window.closed = True
                abandon_window(engine)
                raise RuntimeError(
                    f"the resumed window has only {i} micro-batch(es) but the state was taken "
                    f"after {done}: the loader does not start at state['loader_items'] or "
                    "yields different items. Give acc.windows() the loader from that item on."
                )
        window.yielded = done
        window.backwards = int(saved["backwards"])
        window.form = saved["form"]
        window.final_backward = bool(saved["final_backward"])
        window.losses = list(saved["losses"])
        window.count_py = float(saved["count"])
        window.device_counts = list(saved["device_counts"])
        grads = saved["grads"]
        for name, p in zip(self._names, engine.params, strict=True):
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


def _first_difference(state: dict[str, Any], mine: dict[str, Any]) -> str:
    theirs = list(zip(state.get("params") or [], state.get("shapes") or [], strict=False))
    ours = list(zip(mine["params"], mine["shapes"], strict=True))
    for i, (a, b) in enumerate(zip(theirs, ours, strict=False)):
        if a != b:
            return f"parameter {i} is {a[0]} {tuple(a[1])} there, {b[0]} {tuple(b[1])} here"
    return f"{len(theirs)} parameters there, {len(ours)} here"


def _mode(engine: Engine) -> str:
    """How windows are cut: a state from another mode would resume at the wrong place."""
    if engine.micro_batches is not None:
        return "micro_batches"
    kind = engine.auto.kind if engine.auto is not None else None
    if engine.micro_batch_tokens is not None or kind == "tokens":
        return "micro_batch_tokens"
    return "micro_batch_size" + (", sort_rows" if engine.sort_rows else "")

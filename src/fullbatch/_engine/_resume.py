"""Checkpoint and resume, at a window boundary or between two micro-batches of a window.

What a resumed run needs beyond the model, optimizer, scaler and scheduler states:

- the window so far: gradients, the detached loss sums and counts (summed at the step), ``c``,
  the number of micro-batches done, and the BatchNorm window bookkeeping;
- where the data stands: ``loader_items``, the loader items consumed before the interrupted
  window began. The resumed loader starts there; the window is rebuilt from the same items,
  and the micro-batches already accumulated are read and skipped, not run;
- the RNG state (CPU, and CUDA when initialized), restored just before the first micro-batch
  the resumed run computes, so building fresh objects in between changes nothing;
- the counters ``steps`` and ``skipped_windows``;
- what the state expects of the objects around it, checked at the first window of
  ``acc.windows(loader)`` before anything changes, on every rank together
  (:mod:`fullbatch._engine._resume_check`): the item at ``loader_items`` (a fingerprint; a
  loader at another position raises ``ValueError``), the model's trained parameters and the
  optimizer's state (integer sums of every tensor, and the optimizer's progress: a model or
  an optimizer whose state was not loaded, or was loaded from another checkpoint, raises),
  the scheduler's ``last_epoch``, and that every rank loaded the state of the same window and
  point in it. A scheduler that moved before the first window of an Accumulator that loaded
  no state means the scheduler's state was loaded and the Accumulator's was not: that raises
  too.

The position inside the window is the engine's open window (``engine.window``): a state taken
after a micro-batch's ``window.backward`` resumes after that micro-batch. Taken while a micro-
batch is handed out but before its backward, the state would lose it: that raises; so does a
state inside an "auto" window (first attempt or retry) or an ``accumulate_dtype`` window. A
state is a dict of tensors, numbers, strings and lists (``torch.load(weights_only=True)`` reads
it); each rank saves its own. FSDP2 gradients are DTensor shards: each rank saves its local
shard, and loading checks the mesh size and placements; with ``fsdp_sync="window"`` FSDP2 holds
the window's unsharded gradients itself, so a state inside such a window raises
(``"micro_batch"`` works). A state from another world size, rank, model (parameter names and
shapes), sync kind or ``batchnorm=`` is refused with ``ValueError`` before anything changes;
so is one from another micro-batch size inside a window (at a window boundary
``micro_batch_size`` / ``micro_batch_tokens`` may change: the windows are the loader's items
either way, and normalization is over the whole window), or from another ``micro_batches``
(that is another window). Restored gradients re-arm the loop guard's sentinel: they are
fullbatch's own, not a stray backward.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fullbatch._base._rng import RngState
from fullbatch._engine._checkpoint import (
    check_grads,
    fingerprints,
    identity,
    item_key,
    optimizer_progress,
    param_names,
    window_dict,
)
from fullbatch._engine._core import Engine
from fullbatch._engine._feed import Stream
from fullbatch._engine._resume_check import NO_STATE
from fullbatch._engine._state import WindowState

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


class Resume:
    """The Accumulator's checkpoints: ``state_dict``, ``load_state_dict`` and the loader position.

    A loaded state waits in ``engine.pending`` until the next window is opened
    (:func:`fullbatch._engine._open.open_window` restores it there).
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._names = param_names(engine)
        self._counted: _Counted | None = None
        self._stream: Stream | None = None
        self._base = 0  # loader_items the current acc.windows(loader) started at
        self._scheduler_checked = False  # the first acc.windows() found the scheduler unmoved

    # -- the loader ------------------------------------------------------------------------------

    def stream(self, loader: Any) -> Stream:
        """The stream of a new ``acc.windows(loader)``, counted from the loaded position.

        A scheduler that moved before the first window with no state loaded is noted here
        and raised, on every rank, at the window start with the other resume checks.
        """
        engine = self._engine
        pending = engine.pending
        moved = pending is None and not self._scheduler_checked and engine.guard.scheduler_moved()
        engine.start_problems = NO_STATE if moved else 0
        self._scheduler_checked = not moved
        self._base = pending["loader_items"] if pending is not None else 0
        self._counted = _Counted(loader)
        self._stream = Stream(self._counted)
        return self._stream

    def taken(self) -> int:
        """Loader items consumed so far (an item only peeked at is not consumed)."""
        if self._counted is None or self._stream is None:
            return self._base
        return self._base + self._counted.taken - int(self._stream.holds_peeked)

    # -- state_dict ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        engine = self._engine
        if engine.pending is not None:  # loaded, not resumed yet: still the loaded state
            return dict(engine.pending)
        window = engine.window
        if window is not None and window.phase.closed:  # a step that raised inside
            window = None
        inside = window is not None and window.yielded > 0
        if window is not None and inside:
            self._check_safe(window)
        return {
            "format": FORMAT,
            **identity(engine, self._names),
            "steps": engine.counters.steps,
            "skipped_windows": engine.counters.skipped_windows,
            "loss_scale": engine.loss_scale,
            "scheduler_epoch": engine.guard._scheduler_epoch(),
            "optimizer": optimizer_progress(engine.optimizer),
            "fingerprints": fingerprints(engine),
            "loader_items": window.loader_items if window is not None else self.taken(),
            "next_item": self._next_item(window),
            "rng": RngState().to_dict(),
            "window": window_dict(engine, self._names, window) if window and inside else None,
        }

    def _next_item(self, window: WindowState | None) -> str | None:
        """The key of the item at ``loader_items``; None before any ``acc.windows(loader)``."""
        if window is not None:
            return item_key(window.first_item)
        if self._stream is None:
            return None
        ok, item = self._stream.peek()  # read now, handed to the next window as usual
        return item_key(item if ok else None)

    def _check_safe(self, window: WindowState) -> None:
        """Raise where a state would lose work: an "auto" or ``accumulate_dtype`` window, a
        micro-batch without its backward yet, or gradients FSDP2 holds itself."""
        engine = self._engine
        if engine.micro_plan.is_auto or engine.grad_buffers is not None:
            what = "an 'auto' size" if engine.micro_plan.is_auto else "accumulate_dtype"
            raise RuntimeError(
                f"acc.state_dict() inside window {window.index} with {what}: the window's "
                "state (the size it runs with, or the float32 gradient buffers) is not part of "
                "a state yet. Take the state at a window boundary (after window.step())."
            )
        if window.current_backwards == 0:
            raise RuntimeError(
                f"acc.state_dict() while micro-batch {window.yielded - 1} of window "
                f"{window.index} is handed out but has no backward yet: it would be lost on "
                "resume. Take the state after window.backward(loss_sum, n), at the end of the "
                "loop body."
            )
        held = engine.sync.held_grads()
        if held is not None and not window.final_backward:
            raise RuntimeError(
                f"acc.state_dict() inside window {window.index} {held}, or take the state at a "
                "window boundary (after window.step())."
            )

    # -- load_state_dict -------------------------------------------------------------------------

    def load_state_dict(self, state: dict[str, Any]) -> None:
        engine = self._engine
        window = engine.window
        if window is not None and not window.phase.closed:
            raise RuntimeError(
                f"acc.load_state_dict() while window {window.index} is open: load the "
                "state before acc.windows(loader), on a fresh Accumulator or between windows."
            )
        self._check(state)
        engine.counters.steps = int(state["steps"])
        engine.counters.skipped_windows = int(state["skipped_windows"])
        engine.loss_scale = None if state["loss_scale"] is None else float(state["loss_scale"])
        mine = identity(engine, self._names)  # a micro-batch size changed at a boundary: ours
        engine.pending = {**state, "mode": mine["mode"], "window_size": mine["window_size"]}

    def _check(self, state: Any) -> None:
        """Every check before anything changes: a refused state leaves the Accumulator as it was."""
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise ValueError(
                "not a fullbatch Accumulator state (expected a dict from acc.state_dict() with "
                f"format={FORMAT}); got {type(state).__name__}"
                + (f" with format={state.get('format')!r}" if isinstance(state, dict) else "")
                + "."
            )
        mine = identity(self._engine, self._names)
        size = _size_problem(state, mine)
        if size is not None:
            raise ValueError(size)
        for key in ("world_size", "rank", "sync", "batchnorm"):
            if state.get(key) != mine[key]:
                raise ValueError(
                    f"this state was saved with {key}={state.get(key)!r}, but this Accumulator "
                    f"has {key}={mine[key]!r}; a window's gradients and position only make sense "
                    "in the same setup. Resume with the same world size (each rank loads its own "
                    "state), wrapper and batchnorm= as the run that saved it."
                )
        if state.get("params") != mine["params"] or state.get("shapes") != mine["shapes"]:
            diff = _first_difference(state, mine)
            raise ValueError(
                f"this state was saved for another model: {diff}. Build the same model (same "
                "parameter names and shapes, same optimizer parameters) before loading it."
            )
        window = state.get("window")
        if window is not None:
            check_grads(self._engine, self._names, window)
            saved = state.get("reduce_at_step", mine["reduce_at_step"])  # older states: none
            if saved != mine["reduce_at_step"]:
                raise ValueError(_reduce_problem(bool(saved)))


def _reduce_problem(saved: bool) -> str:
    """A window saved with gradients summed at the step, resumed with them reduced in the
    last backward (or the other way round)."""
    modes = {True: "ddp_sync='step'", False: "ddp_sync='last'"}
    return (
        f"this state was taken inside a window with {modes[saved]}, but this Accumulator has "
        f"{modes[not saved]}: under 'last' the gradients of a window's last backward are "
        "already all-reduced, under 'step' they are summed at step(), so the saved gradients "
        "would be reduced twice or never. Resume with the state's ddp_sync (it may change at "
        "a window boundary, a state taken after window.step())."
    )


def _size_problem(state: dict[str, Any], mine: dict[str, Any]) -> str | None:
    """Why the state's window sizes do not fit this Accumulator's (None: they fit).

    ``micro_batches=K`` makes a window of K loader items: another K is another window. With
    ``micro_batch_size`` / ``micro_batch_tokens`` every loader item is a window whatever its
    micro-batches: at a window boundary their size may change (normalization is over the whole
    window); inside a window the micro-batches done would be cut differently.
    """
    theirs, ours = (
        (state.get("mode"), state.get("window_size")),
        (mine["mode"], mine["window_size"]),
    )
    if theirs == ours:
        return None
    saved, here = _public(*theirs), _public(*ours)
    head = f"this state was saved with {saved}, but this Accumulator has {here}"
    if theirs[0] == ours[0] == "micro_batches":
        return (
            f"{head}: micro_batches=K makes each window K loader items, so another K is "
            "another window (another batch, another optimization), not another micro-batch "
            f"size. Resume with {saved}."
        )
    if "micro_batches" in (theirs[0], ours[0]):
        return (
            f"{head}: with micro_batches each loader item is a micro-batch, with "
            "micro_batch_size or micro_batch_tokens each is a whole window, so "
            f"state['loader_items'] means another position. Resume with {saved}."
        )
    window = state.get("window")
    if window is None:
        return None  # a window boundary: the micro-batch size may change
    return (
        f"{head}, and it was taken inside a window, after {window['micro_batches_done']} "
        "micro-batch(es): the window's micro-batches would be cut differently, so the ones "
        f"already done cannot be skipped. Resume with {saved}; the micro-batch size may change "
        "at a window boundary (a state taken after window.step()), where normalization over "
        "the whole window makes it safe."
    )


def _public(mode: Any, size: Any) -> str:
    """``micro_batches=4``, ``micro_batch_size=3, sort_rows=True``, ``micro_batch_tokens=64``."""
    mode, _, multiple = str(mode).partition(", pad_to_multiple_of=")
    pad = f", pad_to_multiple_of={multiple}" if multiple else ""
    if mode == "micro_batches":
        return f"micro_batches={size!r}"
    if mode.startswith("micro_batch_tokens"):
        return f"micro_batch_tokens={size!r}{pad}"
    return f"micro_batch_size={size!r}" + (", sort_rows=True" if "sort_rows" in mode else "") + pad


def _first_difference(state: dict[str, Any], mine: dict[str, Any]) -> str:
    theirs = list(zip(state.get("params") or [], state.get("shapes") or [], strict=False))
    ours = list(zip(mine["params"], mine["shapes"], strict=True))
    for i, (a, b) in enumerate(zip(theirs, ours, strict=False)):
        if a != b:
            return f"parameter {i} is {a[0]} {tuple(a[1])} there, {b[0]} {tuple(b[1])} here"
    return f"{len(theirs)} parameters there, {len(ours)} here"

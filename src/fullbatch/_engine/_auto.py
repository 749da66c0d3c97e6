"""``micro_batch_size="auto"``: find the micro-batch size by running out of memory.

The first window runs whole (one micro-batch). When a micro-batch raises
``torch.OutOfMemoryError``, the window is abandoned (gradients cleared, references dropped,
the CUDA cache emptied), the size is halved on every rank, and the same window re-runs from
its start with the GradScaler, BatchNorm buffers and RNG state (CPU and CUDA) of that start:
the result equals a run that used the smaller size from the start. Later windows keep the
size; an OOM at one row re-raises.

Ranks agree on every re-run through a tiny all-gather of ``[oom, fatal, used]`` per rank:

- DDP: every micro-batch of an "auto" window runs unsynced and the gradients are all-reduced
  at ``step()`` (what ``ddp_sync="step"`` does). No collective runs inside a forward or
  backward, so a rank that runs out of memory can stop at any point; the agreement comes once,
  at the end of the attempt, before the step's reduction. DDP broadcasts buffers
  (``broadcast_buffers=True``) in a forward that follows a synchronized one: under "auto" only
  the first forward of training (and of its re-runs, since the flag is restored); the ranks
  agree before that forward too.
- FSDP2: every forward all-gathers, so a rank cannot simply stop. The agreement runs before
  the forward of every FSDP module (a forward pre-hook placed ahead of FSDP's all-gather) and
  between ``fn`` and the backward: a rank that ran out of memory joins the next round with
  its flag up, and the others stop there. An OOM *inside* an FSDP2 backward cannot be agreed
  on (the others are inside the backward's collectives): it propagates, and the other ranks
  fail at their next collective within the process-group timeout.

The size is a "size that halves": :class:`AutoSize` takes how to measure a window and how to
cut it, so the same machinery can serve a token budget.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from fullbatch._base._autosize import AutoSize
from fullbatch._base._modelstate import BatchNormBuffers
from fullbatch._base._prepass import free_memory
from fullbatch._base._rng import RngState
from fullbatch._base._stats import StepStats
from fullbatch._base._sync import Sync
from fullbatch._engine._core import Engine, Handle
from fullbatch._engine._feed import Feed, Stream
from fullbatch._engine._open import open_window
from fullbatch._engine._run import MicroBatchFn, abandon_locally, run_micro_batches

__all__ = ["Runner", "check_peers", "run_auto"]

# One attempt at a window: ``runner(window, fn, before_backward)`` runs its micro-batches and
# backward calls, no step (``run_micro_batches``; ``window.run_coupled`` runs both passes).
Runner = Callable[[Handle, MicroBatchFn, Callable[[], None]], None]

_OOM, _FATAL, _USED = range(3)


class _PeerOutOfMemory(Exception):
    """Another rank ran out of memory: this rank stops its attempt (the round is agreed)."""

    def __init__(self, table: list[list[float]]) -> None:
        super().__init__("another rank ran out of memory")
        self.table = table


def _agree(sync: Sync, *, oom: bool, fatal: bool, used: int) -> list[list[float]]:
    """One agreement round: every rank's ``[oom, fatal, used]`` (local: just ours)."""
    row = torch.tensor([float(oom), float(fatal), float(used)], dtype=torch.float64)
    return sync.all_gather(row).tolist()


def check_peers(sync: Sync) -> None:
    table = _agree(sync, oom=False, fatal=False, used=0)
    if any(r[_OOM] for r in table):
        raise _PeerOutOfMemory(table)


class _Snapshot:
    """What a re-run must find as it was at the window's start (gradients are None there)."""

    def __init__(self, engine: Engine) -> None:
        self.rng = RngState()
        scaler = engine.step_plan.scaler
        self.scaler = scaler.state_dict() if scaler is not None else None
        self.buffers = BatchNormBuffers(engine.model, training_only=False)
        # DDP decides whether a forward broadcasts buffers from the previous forward, in a
        # post-forward step that a forward cut short by an OOM never reaches: put it back, or
        # ranks disagree on the next broadcast.
        self.forward_sync = getattr(engine.model, "require_forward_param_sync", None)

    def restore(self, engine: Engine) -> None:
        self.rng.restore()
        scaler = engine.step_plan.scaler
        if scaler is not None and self.scaler is not None:
            scaler.load_state_dict(self.scaler)
        self.buffers.restore()
        if self.forward_sync is not None:
            engine.model.require_forward_param_sync = self.forward_sync


def _attempt(
    window: Handle, fn: MicroBatchFn, auto: AutoSize, sync: Sync, runner: Runner
) -> list[list[float]] | None:
    """Run the window's micro-batches; None when no rank ran out of memory, else the table."""
    # FSDP2: a backward runs collectives (DDP under "auto" reduces at step(): none), so the
    # ranks agree between fn and the backward, and an OOM inside a backward cannot be agreed.
    in_backward = sync.syncs_in_backward
    phase = ["forward"]

    def forward(micro: Any) -> Any:
        phase[0] = "forward"
        return fn(micro)

    def before_backward() -> None:
        if in_backward:
            check_peers(sync)
        phase[0] = "backward"

    try:
        runner(window, forward, before_backward)
    except _PeerOutOfMemory as peer:
        return peer.table
    except torch.OutOfMemoryError:
        fatal = auto.used <= 1
        if in_backward and phase[0] == "backward":
            abandon_locally(window)
            raise  # the others are inside the backward's collectives: no agreement possible
        table = _agree(sync, oom=True, fatal=fatal, used=auto.used)
        if fatal:
            abandon_locally(window)
            raise  # one row per micro-batch does not fit: nothing smaller to try
        return table
    except BaseException:
        abandon_locally(window)
        raise
    table = _agree(sync, oom=False, fatal=False, used=auto.used)
    return table if any(r[_OOM] for r in table) else None


def _restart(window: Handle, micros: list[Any], stream: Stream) -> None:
    """A fresh attempt at the same window, opened like every window (its own window-start
    exchange: padding, totals), on the same handle."""
    old = window._state
    if micros:
        stream.last = micros[-1]
    state = open_window(
        window._engine,
        Feed(micros),
        stream,
        index=old.index,
        loader_items=old.loader_items,
        first_item=old.first_item,
        by_run=True,
    )
    if not state:  # some rank ran out of memory on data: this cannot be the end
        raise RuntimeError("internal error: an 'auto' re-run found no data on any rank.")
    state.stats, state.stats_seconds = old.stats, old.stats_seconds  # never taken twice
    window._state = state


def run_auto(window: Handle, fn: MicroBatchFn, runner: Runner = run_micro_batches) -> StepStats:
    """The body of :meth:`Window.run` and :meth:`Window.run_coupled` under "auto"."""
    engine = window._engine
    auto, stream = engine.micro_plan.auto, window._state.stream
    assert auto is not None and stream is not None
    sync = engine.sync
    snapshot = _Snapshot(engine)

    def agree_before_forward(*_: Any) -> None:
        if sync.forward_collective():
            check_peers(sync)

    hooks = [
        m.register_forward_pre_hook(agree_before_forward, prepend=True)
        for m in sync.forward_collective_modules()
    ]
    retries = 0
    try:
        while True:
            table = _attempt(window, fn, auto, sync, runner)
            if table is None:
                break
            abandon_locally(window)
            fatal = [rank for rank, r in enumerate(table) if r[_FATAL]]
            if fatal:
                raise RuntimeError(
                    f"rank(s) {fatal} ran out of memory with micro-batches of one row; "
                    f"{engine.micro_plan.size_name}='auto' has nothing smaller to try (their "
                    "error is raised there). Use a smaller model, activation checkpointing or "
                    "lower precision."
                )
            limit = min(int(r[_USED]) // 2 for r in table if r[_OOM])
            free_memory()
            snapshot.restore(engine)
            _restart(window, auto.shrink(limit), stream)
            retries += 1
    finally:
        for hook in hooks:
            hook.remove()
        auto.release()
    stats = window.step()
    return dataclasses.replace(stats, retries=retries)

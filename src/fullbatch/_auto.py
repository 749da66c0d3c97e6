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
import gc
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fullbatch._run import MicroBatchFn, abandon_locally, run_micro_batches
from fullbatch._split import count_rows, split_rows
from fullbatch._stats import StepStats

if TYPE_CHECKING:
    from fullbatch._accumulator import Accumulator
    from fullbatch._sync import Sync
    from fullbatch._window import Window
    from fullbatch._windows import Stream

__all__ = ["AutoSize", "Runner", "run_auto"]

# One attempt at a window: ``runner(window, fn, before_backward)`` runs its micro-batches and
# backward calls, no step (``run_micro_batches``; ``window.run_coupled`` runs both passes).
Runner = Callable[["Window", MicroBatchFn, Callable[[], None]], None]

_OOM, _FATAL, _USED = range(3)


class AutoSize:
    """Where an "auto" size stands, and the current window's loader item to re-cut.

    Args:
        whole: the size of a whole window (e.g. its row count).
        cut: ``cut(item, size)`` -> micro-batches of at most ``size``.
    """

    def __init__(
        self,
        whole: Callable[[Any], int],
        cut: Callable[[Any, int], list[Any]],
        kind: str = "rows",
    ) -> None:
        self.kind = kind  # "rows" (micro_batch_size) or "tokens" (micro_batch_tokens)
        self._whole = whole
        self._cut = cut
        self.limit: int | None = None  # None: whole windows (no OOM seen yet)
        self.size: int | None = None  # what the last window ran with
        self.used = 0  # what the current attempt runs with on this rank (0: no data)
        self.stream: Stream | None = None
        self._item: Any = None

    @classmethod
    def rows(cls) -> AutoSize:
        return cls(count_rows, split_rows)

    @staticmethod
    def ddp_sync(model: nn.Module, ddp_sync: str) -> str:
        """Under DDP, "auto" reduces gradients at ``step()``: see the module docstring."""
        from torch.nn.parallel import DistributedDataParallel

        return "step" if isinstance(model, DistributedDataParallel) else ddp_sync

    def split(self, item: Any, stream: Stream) -> list[Any]:
        """Cut a new window's loader item (``None`` when this rank's loader has ended)."""
        self._item, self.stream = item, stream
        return self._recut()

    def _recut(self) -> list[Any]:
        if self._item is None:
            self.used = 0
            return []
        whole = self._whole(self._item)
        if whole == 0:
            self.used = 0
            return []
        self.used = whole if self.limit is None else min(self.limit, whole)
        self.size = self.used
        return self._cut(self._item, self.used)

    def shrink(self, limit: int) -> list[Any]:
        """Set the new limit and re-cut the current window's item with it."""
        self.limit = limit
        return self._recut()

    def release(self) -> None:
        self._item = None


class _PeerOutOfMemory(Exception):
    """Another rank ran out of memory: this rank stops its attempt (the round is agreed)."""

    def __init__(self, table: list[list[float]]) -> None:
        super().__init__("another rank ran out of memory")
        self.table = table


def _agree(sync: Sync, *, oom: bool, fatal: bool, used: int) -> list[list[float]]:
    """One agreement round: every rank's ``[oom, fatal, used]`` (local: just ours)."""
    row = torch.tensor([float(oom), float(fatal), float(used)], dtype=torch.float64)
    return sync.all_gather(row).tolist()


def _check_peers(sync: Sync) -> None:
    table = _agree(sync, oom=False, fatal=False, used=0)
    if any(r[_OOM] for r in table):
        raise _PeerOutOfMemory(table)


class _Snapshot:
    """What a re-run must find as it was at the window's start (gradients are None there)."""

    def __init__(self, acc: Accumulator) -> None:
        self.cpu = torch.get_rng_state()
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        self.cuda = torch.cuda.get_rng_state_all() if cuda else None
        self.scaler = acc._scaler.state_dict() if acc._scaler is not None else None
        self.buffers = [
            (b, b.detach().clone())
            for m in acc.model.modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm)
            for b in m.buffers(recurse=False)
        ]
        # DDP decides whether a forward broadcasts buffers from the previous forward, in a
        # post-forward step that a forward cut short by an OOM never reaches: put it back, or
        # ranks disagree on the next broadcast.
        self.forward_sync = getattr(acc.model, "require_forward_param_sync", None)

    def restore(self, acc: Accumulator) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        if acc._scaler is not None and self.scaler is not None:
            acc._scaler.load_state_dict(self.scaler)
        with torch.no_grad():
            for buffer, saved in self.buffers:
                buffer.copy_(saved)
        if self.forward_sync is not None:
            acc.model.require_forward_param_sync = self.forward_sync


def _attempt(
    window: Window, fn: MicroBatchFn, auto: AutoSize, sync: Sync, runner: Runner
) -> list[list[float]] | None:
    """Run the window's micro-batches; None when no rank ran out of memory, else the table."""
    fsdp = sync.kind == "fsdp2"
    phase = ["forward"]

    def forward(micro: Any) -> Any:
        phase[0] = "forward"
        return fn(micro)

    def before_backward() -> None:
        if fsdp:
            _check_peers(sync)
        phase[0] = "backward"

    try:
        runner(window, forward, before_backward)
    except _PeerOutOfMemory as peer:
        return peer.table
    except torch.OutOfMemoryError:
        fatal = auto.used <= 1
        if fsdp and phase[0] == "backward":
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


def _restart(acc: Accumulator, window: Window, micros: list[Any], stream: Stream) -> Window:
    """A fresh attempt at the same window: its own window-start exchange (padding, totals)."""
    from fullbatch._window import Window
    from fullbatch._windows import Feed

    feed = Feed(micros)
    if micros:
        stream.last = micros[-1]
    start = acc._start_window(feed, stream)
    if not start:  # some rank ran out of memory on data: this cannot be the end
        raise RuntimeError("internal error: an 'auto' re-run found no data on any rank.")
    loss_scale, totals = start
    if acc._batchnorm is not None:
        acc._batchnorm.start()
    attempt = Window(acc, feed, index=window.index, loss_scale=loss_scale, totals=totals)
    attempt._by_run = True
    acc._guard.start_window(window.index)
    return attempt


def _free() -> None:
    gc.collect(1)  # young cycles through the failed forward's frames (a full collect: ~0.5 s)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def run_auto(window: Window, fn: MicroBatchFn, runner: Runner = run_micro_batches) -> StepStats:
    acc = window._acc
    auto = acc._auto
    assert auto is not None and auto.stream is not None
    sync = acc._sync
    snapshot = _Snapshot(acc)

    def agree_before_forward(*_: Any) -> None:
        if sync.forward_collective():
            _check_peers(sync)

    hooks = [
        m.register_forward_pre_hook(agree_before_forward, prepend=True)
        for m in sync.forward_collective_modules()
    ]
    retries = 0
    attempt = window
    try:
        while True:
            table = _attempt(attempt, fn, auto, sync, runner)
            if table is None:
                break
            abandon_locally(attempt)
            fatal = [rank for rank, r in enumerate(table) if r[_FATAL]]
            if fatal:
                raise RuntimeError(
                    f"rank(s) {fatal} ran out of memory with micro-batches of one row; "
                    "micro_batch_size='auto' has nothing smaller to try (their error is "
                    "raised there). Use a smaller model, activation checkpointing or lower "
                    "precision."
                )
            limit = min(int(r[_USED]) // 2 for r in table if r[_OOM])
            del attempt
            _free()
            snapshot.restore(acc)
            attempt = _restart(acc, window, auto.shrink(limit), auto.stream)
            retries += 1
    finally:
        for hook in hooks:
            hook.remove()
        auto.release()
    stats = attempt.step()
    return dataclasses.replace(stats, retries=retries)

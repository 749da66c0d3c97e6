"""``window.run(fn)``: fullbatch calls the user's per-micro-batch function.

Because the library makes the call, it sees the exceptions the function raises. That is
what ``micro_batch_size="auto"`` needs: Python never hands an exception raised in a ``for``
body back to the iterator, so the plain loop cannot recover from an out-of-memory error.

Without "auto", :func:`run_window` is exactly the plain loop (same sync, counts, padding
micro-batches, skips). With "auto", see :mod:`fullbatch._engine._auto` for the retry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fullbatch._base._stats import StepStats
from fullbatch._engine._core import Handle
from fullbatch._engine._open import end_window
from fullbatch._engine._state import Phase

__all__ = ["MicroBatchFn", "abandon_locally", "run_micro_batches", "run_window"]

MicroBatchFn = Callable[[Any], Any]


def _unpack(out: Any) -> tuple[torch.Tensor, Any]:
    """``(loss_sum, count)``, or a bare 0-dim tensor share (count ``None``)."""
    if isinstance(out, torch.Tensor):
        return out, None
    if isinstance(out, tuple | list) and len(out) == 2:
        return out[0], out[1]
    got = f"a {type(out).__name__}" + (f" of length {len(out)}" if hasattr(out, "__len__") else "")
    raise ValueError(
        f"the function given to window.run returned {got}; return (loss_sum, count), e.g. "
        "`return fb.cross_entropy_sum(model(micro['x']), micro['y'])`, or a 0-dim share "
        "divided by a window.totals entry when the Accumulator has counts=."
    )


def run_micro_batches(
    window: Handle, fn: MicroBatchFn, before_backward: Callable[[], None] | None = None
) -> None:
    """Iterate ``window`` and backpropagate what ``fn`` returns for every micro-batch.

    ``before_backward`` runs between ``fn`` and the backward (FSDP2's agreement under "auto").
    """
    for micro in window:
        loss, count = _unpack(fn(micro))
        del micro
        if before_backward is not None:
            before_backward()
        if count is None:
            window.backward(loss)
        else:
            window.backward(loss, count)
        del loss, count


def abandon_locally(window: Handle) -> None:
    """Close ``window`` without a collective: no gradients, sync flags and BN statistics back.

    Used when the user's function raised: the other ranks learn of it at their next
    collective (and fail there within the process-group timeout), as with the plain loop.
    """
    state = window._state
    if state.phase.closed:
        return
    state.feed.fill()  # the window's unread micro-batches go with it: boundaries stay put
    end_window(window._engine, state, Phase.ABANDONED)


def run_window(window: Handle, fn: MicroBatchFn) -> StepStats:
    """The body of :meth:`Window.run` without "auto" (with it: ``_auto.run_auto``)."""
    try:
        run_micro_batches(window, fn)
    except BaseException:
        abandon_locally(window)
        raise
    return window.step()

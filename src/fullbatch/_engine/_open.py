"""Opening and ending a window: the only two writers of ``engine.window``.

Every driver opens its windows with :func:`open_window`: the plain loop, ``window.run`` and
``window.run_coupled`` (through ``acc.windows(loader)``), an "auto" retry (the same window
again, cut smaller) and a resumed window (a loaded state is restored into the window it was
taken in). Every window ends in :func:`end_window`: stepped, skipped, discarded or abandoned.
"""

from __future__ import annotations

from typing import Any, Literal

from fullbatch._engine._checkpoint import param_names, restore_window
from fullbatch._engine._core import Engine
from fullbatch._engine._feed import Feed, Stream
from fullbatch._engine._resume_check import ResumeCheck
from fullbatch._engine._start import start_window
from fullbatch._engine._state import Phase, WindowState

__all__ = ["end_window", "open_window"]


def open_window(
    engine: Engine,
    feed: Feed,
    stream: Stream,
    *,
    index: int,
    loader_items: int,
    first_item: Any,
    by_run: bool = False,
) -> WindowState | Literal[False] | None:
    """Open window ``index`` on ``feed``: the window-start exchange, then the window's state.

    ``first_item`` is the window's first loader item on this rank (None: it has none). A
    loaded state (``engine.pending``) is checked against it and the objects around it, on
    every rank, before anything changes (:mod:`fullbatch._engine._resume_check`), then
    restored into the window. Returns None at the end of the data, False for a dropped window.

    Raises:
        ResumeMismatch: (a ``ValueError`` and a ``RuntimeError``) on every rank, when a loaded
            state does not fit on some rank: the loader's position, the model's parameters,
            the optimizer's or the scheduler's state, the other ranks' states.
    """
    pending = engine.pending
    names = param_names(engine) if pending is not None else []
    resume = ResumeCheck.local(engine, names, feed, first_item)
    start = start_window(engine, feed, stream, index=index, resume=resume)
    engine.start_problems = 0
    if pending is not None:
        engine.guard.scheduler_stepped()  # loading the scheduler's state moved it, not the user
    if start is None or start is False:
        return start
    if engine.batchnorm is not None:
        engine.batchnorm.start()
    state = WindowState(
        feed,
        index=index,
        loss_scale=start.loss_scale,
        totals=start.totals,
        padding=start.padding,
        stream=stream,
        loader_items=loader_items,
        first_item=first_item,
        by_run=by_run,
    )
    engine.guard.start_window(index)
    if pending is not None:
        try:
            state = restore_window(engine, state, pending)
        except BaseException:
            end_window(engine, state, Phase.ABANDONED)
            raise
        engine.pending = None
    engine.window = state
    return state


def end_window(engine: Engine, state: WindowState, phase: Phase) -> None:
    """End ``state`` as ``phase`` says: gradients cleared, sync flags and BatchNorm back.

    A stepped window applies its BatchNorm window statistics; any other drops them (and, for
    a window that did not reach the step, restores the wrapper's sync flags and forgets the
    gradients FSDP2 holds outside ``param.grad``).
    """
    assert phase.closed and phase is not Phase.STEPPING
    state.phase = phase
    if engine.window is state:
        engine.window = None
    engine.guard.end_window()
    reached_step = phase in (Phase.STEPPED, Phase.SKIPPED)
    if not reached_step:
        engine.sync.end()
    engine.clear_grads()
    if not reached_step:
        engine.sync.drop_unreduced_grads()  # FSDP2 keeps unsynced gradients outside param.grad
    engine.sync.finish_window()
    if engine.batchnorm is not None:
        engine.batchnorm.finish(apply=phase is Phase.STEPPED)

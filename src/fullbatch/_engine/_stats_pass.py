"""``window.stats(fn)``: a window statistic, computed once per window before its first backward.

A window statistic is a quantity taken from every micro-batch of the window on every rank
that enters each micro-batch's loss as a constant: the ``f_i`` of an MoE load-balancing loss,
the threshold of a top-fraction token selection. With it every backward of the window sees
the constant the full batch would, and the step equals the full batch's (docs/moe.md).

The pre-pass runs ``fn`` without gradients on every micro-batch of the window (padding
micro-batches too, whose results are dropped: FSDP2's forwards all-gather on every rank),
reduces the results over the counting group (the data-parallel ranks, and context parallel
where the Accumulator counts over it) in one collective, and keeps them in the window's state
under a key. Activation recomputation never reaches it (it is not part of any backward); an
"auto" retry re-runs the window's micro-batches but keeps the statistic; a mid-window
checkpoint holds it, so a resumed window uses it and never runs a pre-pass over the
micro-batches left. The RNG state is restored after the pre-pass (the training forwards draw
the dropout masks they would draw without it) and BatchNorm buffers are put back.

A pre-pass forward that raises ``torch.OutOfMemoryError`` (under ``"auto"`` the first window
is one whole micro-batch) is re-run on the two halves of its micro-batch, down to one row: a
summed statistic is the sum over any split of the rows, a concatenated one their
concatenation in order, so the value is the same. Not where forwards run collectives (FSDP2:
the ranks would run different numbers of forwards): there the error propagates, naming the
fix. The pre-pass itself (no grad, RNG and BatchNorm put back, the reductions, the halving)
is ``fullbatch._base._prepass``, shared with ``fullbatch.deepspeed``'s windows.
"""

from __future__ import annotations

import time
from typing import Any

from fullbatch._base._prepass import (
    StatsFn,
    check_reduce,
    default_key,
    reduce_results,
    run_pass,
    too_late,
)
from fullbatch._engine._core import Handle
from fullbatch._engine._state import Phase

__all__ = ["ALL_GATHERS", "window_stats"]

#: why the pre-pass under FSDP2 does not halve, and the fix (an OOM error names it)
ALL_GATHERS = (
    "whose forwards run FSDP2's all-gathers on every rank, so it cannot re-run one rank's "
    "micro-batch in halves: give the Accumulator a micro_batch_size whose no-grad forward fits"
)


def _check_open(window: Handle, key: str) -> None:
    state = window._state
    if state.phase.closed:
        raise RuntimeError(f"window.stats on window {state.index}, which was already ended.")
    if state.phase is not Phase.OPEN or state.yielded or state.backwards:
        raise too_late(
            key,
            f"window {state.index}",
            f"{state.yielded} yielded, {state.backwards} backward call(s)",
            "Call `stats = window.stats(fn)` before `for micro in window:` or "
            "`window.run(...)`; a state saved inside a window holds the statistics computed "
            "before it (save it after window.stats).",
        )
    if window._engine.batchnorm is not None:
        raise ValueError(
            "window.stats runs no-grad forwards, which batchnorm='window' would count as "
            "micro-batches of the window; build the Accumulator without batchnorm='window'."
        )


def window_stats(window: Handle, fn: StatsFn, *, reduce: str, key: str | None) -> Any:
    """The body of :meth:`Window.stats`: the cached statistic, or the pre-pass that makes it."""
    check_reduce(reduce)
    key = default_key(fn) if key is None else key
    state = window._state
    if key in state.stats:
        return state.stats[key]
    _check_open(window, key)
    began = time.perf_counter()
    engine = window._engine
    feed = state.feed
    feed.fill()
    micros = [(m, False) for m in feed.real] + [(m, True) for m in feed._padding]
    if not micros:
        raise ValueError(
            f"window.stats: this rank holds no micro-batch in window {state.index}, so "
            "it cannot take part in the statistic; give the Accumulator padding_micro_batch="
            "lambda: <a micro-batch> or every rank data."
        )
    sync = engine.sync
    results, rebuild = run_pass(
        fn,
        micros,
        engine.model,
        split=not sync.sharded,
        collectives=ALL_GATHERS,
        quiet=None if sync.sharded else sync.no_collectives(),
    )
    value = reduce_results(
        results,
        rebuild,
        reduce,
        padded=not feed.real,
        all_reduce_sum=sync.all_reduce_sum,
        all_gather=None if sync.group is None else sync.all_gather,
    )
    state.stats[key] = value
    state.stats_seconds += time.perf_counter() - began
    return value

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
fix.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch

from fullbatch._base._modelstate import BatchNormBuffers
from fullbatch._base._rng import RngState
from fullbatch._base._split import count_rows, split_rows
from fullbatch._base._sync import Sync
from fullbatch._engine._auto import free_memory
from fullbatch._engine._core import Handle
from fullbatch._engine._state import Phase

__all__ = ["REDUCTIONS", "StatsFn", "default_key", "window_stats"]

StatsFn = Callable[[Any], Any]
REDUCTIONS = ("sum", "cat")

_RETURN_FIX = (
    "window.stats(fn): fn(micro) must return a tensor, or a dict, tuple or list of tensors, "
    "e.g. `return fb.moe.router_counts(model(**inputs, output_router_logits=True)"
    ".router_logits, top_k=2)`."
)


def default_key(fn: StatsFn) -> str:
    """``module.qualname:line`` of ``fn``: two lambdas on different lines differ, and the same
    code gives the same key after a resume."""
    code = getattr(fn, "__code__", None)
    line = f":{code.co_firstlineno}" if code is not None else ""
    name = getattr(fn, "__qualname__", type(fn).__qualname__)
    return f"{getattr(fn, '__module__', '')}.{name}{line}"


def _leaves(out: Any) -> tuple[list[torch.Tensor], Callable[[list[torch.Tensor]], Any]]:
    """``out``'s tensors in order, and how to put tensors of the same layout back."""
    if isinstance(out, torch.Tensor):
        return [out], lambda ts: ts[0]
    if isinstance(out, dict) and out and all(isinstance(v, torch.Tensor) for v in out.values()):
        keys = list(out)
        return [out[k] for k in keys], lambda ts: dict(zip(keys, ts, strict=True))
    if isinstance(out, tuple | list) and out and all(isinstance(v, torch.Tensor) for v in out):
        kind = type(out)
        return list(out), lambda ts: kind(ts) if kind is list else tuple(ts)
    raise ValueError(f"fn returned {type(out).__name__}. {_RETURN_FIX}")


def _check_open(window: Handle, key: str) -> None:
    state = window._state
    if state.phase.closed:
        raise RuntimeError(f"window.stats on window {state.index}, which was already ended.")
    if state.phase is not Phase.OPEN or state.yielded or state.backwards:
        raise RuntimeError(
            f"window.stats(fn) (key {key!r}) on window {state.index} after its micro-batches "
            f"began ({state.yielded} yielded, {state.backwards} backward call(s)): a window "
            "statistic must be the same constant in every backward of the window, so it is "
            "computed before the first. Call `stats = window.stats(fn)` before "
            "`for micro in window:` or `window.run(...)`; a state saved inside a window holds "
            "the statistics computed before it (save it after window.stats)."
        )
    if window._engine.batchnorm is not None:
        raise ValueError(
            "window.stats runs no-grad forwards, which batchnorm='window' would count as "
            "micro-batches of the window; build the Accumulator without batchnorm='window'."
        )


def _halving(fn: StatsFn, micro: Any, *, split: bool) -> list[Any]:
    """``fn``'s outputs on ``micro``, or on its halves (recursively) where it runs out of memory."""
    try:
        return [fn(micro)]
    except torch.OutOfMemoryError as error:
        if not split:
            raise torch.OutOfMemoryError(
                f"{error} (in window.stats's pre-pass, whose forwards run FSDP2's all-gathers "
                "on every rank, so it cannot re-run one rank's micro-batch in halves: give "
                "the Accumulator a micro_batch_size whose no-grad forward fits)"
            ) from error
        try:
            rows = count_rows(micro)
        except ValueError:
            raise error from None
        if rows <= 1:
            raise
    free_memory()
    halves = split_rows(micro, -(-rows // 2))
    return [out for half in halves for out in _halving(fn, half, split=True)]


def _run(window: Handle, fn: StatsFn) -> tuple[list[list[torch.Tensor]], Any]:
    """``fn`` on every micro-batch of the window, no gradients, no collectives but FSDP2's."""
    engine = window._engine
    feed = window._state.feed
    feed.fill()
    micros = [(m, False) for m in feed.real] + [(m, True) for m in feed._padding]
    if not micros:
        raise ValueError(
            f"window.stats: this rank holds no micro-batch in window {window._state.index}, so "
            "it cannot take part in the statistic; give the Accumulator padding_micro_batch="
            "lambda: <a micro-batch> or every rank data."
        )
    sync = engine.sync
    quiet = sync.no_collectives() if not sync.sharded else contextlib.nullcontext()
    rng, buffers = RngState(), BatchNormBuffers(engine.model, training_only=True)
    results: list[list[torch.Tensor]] = []
    rebuild: Any = None
    try:
        with torch.no_grad(), quiet:
            for micro, padding in micros:
                for out in _halving(fn, micro, split=not sync.sharded):
                    leaves, rebuild_here = _leaves(out)
                    if not padding:
                        results.append([t.detach() for t in leaves])
                        rebuild = rebuild_here
                    elif rebuild is None:  # shapes for a rank holding only padding
                        rebuild = rebuild_here
                        results.append([torch.zeros_like(t) for t in leaves])
    finally:
        rng.restore()
        buffers.restore()
    return results, rebuild


def _sum(sync: Sync, results: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Each leaf summed over micro-batches (float64) and over the counting group."""
    shapes = [t.shape for t in results[0]]
    for row in results:
        if [t.shape for t in row] != shapes:
            got = [tuple(t.shape) for t in row]
            raise ValueError(
                f"window.stats(fn, reduce='sum'): fn returned shapes {got} for one "
                f"micro-batch and {[tuple(s) for s in shapes]} for another; a summed "
                "statistic has the same shape in every micro-batch (use reduce='cat' for "
                "per-token values)."
            )
    where = results[0][0].device
    flat = torch.stack(
        [torch.cat([t.to(where, torch.float64).reshape(-1) for t in row]) for row in results]
    ).sum(0)
    total = sync.all_reduce_sum(flat)
    pieces = total.split([int(torch.Size(s).numel()) for s in shapes])
    return [p.reshape(s) for p, s in zip(pieces, shapes, strict=True)]


def _cat(sync: Sync, results: list[list[torch.Tensor]], padded: bool) -> list[torch.Tensor]:
    """Each leaf concatenated along dim 0 over micro-batches, then over ranks in rank order."""
    rows = 0 if padded else len(results)
    local = [
        torch.cat([row[i] for row in results[:rows]]) if rows else results[0][i][:0]
        for i in range(len(results[0]))
    ]
    if sync.group is None:
        return local
    sizes = torch.tensor([float(t.shape[0]) for t in local], dtype=torch.float64)
    every = [[int(x) for x in r] for r in sync.all_gather(sizes).tolist()]
    out = []
    for i, t in enumerate(local):
        most = max(r[i] for r in every)
        buf = t.new_zeros((most, *t.shape[1:]))
        buf[: t.shape[0]] = t
        gathered = sync.all_gather(buf)
        out.append(torch.cat([gathered[r, : every[r][i]] for r in range(len(every))]))
    return out


def window_stats(window: Handle, fn: StatsFn, *, reduce: str, key: str | None) -> Any:
    """The body of :meth:`Window.stats`: the cached statistic, or the pre-pass that makes it."""
    if reduce not in REDUCTIONS:
        raise ValueError(f"window.stats: reduce={reduce!r}; use one of {REDUCTIONS}.")
    key = default_key(fn) if key is None else key
    state = window._state
    if key in state.stats:
        return state.stats[key]
    _check_open(window, key)
    began = time.perf_counter()
    results, rebuild = _run(window, fn)
    sync = window._engine.sync
    if reduce == "sum":  # a rank with padding only sums zeros
        value = rebuild(_sum(sync, results))
    else:
        value = rebuild(_cat(sync, results, padded=not state.feed.real))
    state.stats[key] = value
    state.stats_seconds += time.perf_counter() - began
    return value

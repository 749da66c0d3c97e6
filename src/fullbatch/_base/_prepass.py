"""A window statistic's pre-pass, without the window: what ``window.stats(fn)`` does in every
route that has one (``fb.Accumulator``'s windows, ``fullbatch.deepspeed``'s).

``fn`` runs on each micro-batch without gradients; the RNG state and the BatchNorm buffers
are put back after it (the training forwards draw the dropout masks they would draw without
it); its tensors are summed in float64 or concatenated along dim 0, then over the ranks in
one collective the caller hands in. A forward that runs out of memory is re-run on the two
halves of its micro-batch (a sum over any split of the rows is the same sum, a concatenation
the same rows in order), except where forwards run collectives: there the ranks would run
different numbers of forwards, so the error propagates with the caller's fix. What is kept
under which key, and when a call is too late, is the caller's (docs/moe.md).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from fullbatch._base._modelstate import BatchNormBuffers
from fullbatch._base._rng import RngState
from fullbatch._base._split import count_rows, split_rows

__all__ = [
    "REDUCTIONS",
    "StatsFn",
    "check_reduce",
    "default_key",
    "free_memory",
    "halving",
    "reduce_results",
    "run_pass",
    "too_late",
]

StatsFn = Callable[[Any], Any]
Reduce = Callable[[torch.Tensor], torch.Tensor]
REDUCTIONS = ("sum", "cat")

_RETURN_FIX = (
    "window.stats(fn): fn(micro) must return a tensor, or a dict, tuple or list of tensors, "
    "e.g. `return fb.moe.router_counts(model(**inputs, output_router_logits=True)"
    ".router_logits, top_k=2)`."
)


def check_reduce(reduce: str) -> None:
    if reduce not in REDUCTIONS:
        raise ValueError(f"window.stats: reduce={reduce!r}; use one of {REDUCTIONS}.")


def default_key(fn: StatsFn) -> str:
    """``module.qualname:line`` of ``fn``: two lambdas on different lines differ, and the same
    code gives the same key after a resume."""
    code = getattr(fn, "__code__", None)
    line = f":{code.co_firstlineno}" if code is not None else ""
    name = getattr(fn, "__qualname__", type(fn).__qualname__)
    return f"{getattr(fn, '__module__', '')}.{name}{line}"


def too_late(key: str, where: str, began: str, fix: str) -> RuntimeError:
    """The refusal of a statistic asked for once the window's backwards may have begun."""
    return RuntimeError(
        f"window.stats(fn) (key {key!r}) on {where} after its micro-batches began ({began}): "
        "a window statistic must be the same constant in every backward of the window, so it "
        f"is computed before the first. {fix}"
    )


def free_memory() -> None:
    """What an out-of-memory error left: the failed forward's frames, the CUDA cache."""
    gc.collect(1)  # young cycles through the failed forward's frames (a full collect: ~0.5 s)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


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


def halving(fn: StatsFn, micro: Any, *, split: bool, collectives: str) -> list[Any]:
    """``fn``'s outputs on ``micro``, or on its halves (recursively) where it runs out of
    memory; ``split=False`` re-raises at once, with ``collectives`` (why, and the fix)."""
    try:
        return [fn(micro)]
    except torch.OutOfMemoryError as error:
        if not split:
            raise torch.OutOfMemoryError(
                f"{error} (in window.stats's pre-pass, {collectives})"
            ) from error
        try:
            rows = count_rows(micro)
        except ValueError:
            raise error from None
        if rows <= 1:
            raise
    free_memory()
    halves = split_rows(micro, -(-rows // 2))
    return [
        out for half in halves for out in halving(fn, half, split=True, collectives=collectives)
    ]


def run_pass(
    fn: StatsFn,
    micros: Sequence[tuple[Any, bool]],
    model: nn.Module,
    *,
    split: bool,
    collectives: str,
    quiet: contextlib.AbstractContextManager[Any] | None = None,
) -> tuple[list[list[torch.Tensor]], Any]:
    """``fn`` on every ``(micro-batch, is_padding)`` under ``quiet`` (a no-sync context), no
    gradients; the RNG state and ``model``'s BatchNorm buffers put back. The real ones'
    tensors, and how to rebuild ``fn``'s layout (a padding-only list gives zeros once)."""
    rng, buffers = RngState(), BatchNormBuffers(model, training_only=True)
    results: list[list[torch.Tensor]] = []
    rebuild: Any = None
    try:
        with torch.no_grad(), quiet or contextlib.nullcontext():
            for micro, padding in micros:
                for out in halving(fn, micro, split=split, collectives=collectives):
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


def _sum(results: list[list[torch.Tensor]], all_reduce_sum: Reduce) -> list[torch.Tensor]:
    """Each leaf summed over micro-batches (float64) and by ``all_reduce_sum`` over ranks."""
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
    total = all_reduce_sum(flat)
    pieces = total.split([int(torch.Size(s).numel()) for s in shapes])
    return [p.reshape(s) for p, s in zip(pieces, shapes, strict=True)]


def _cat(
    results: list[list[torch.Tensor]], padded: bool, all_gather: Reduce | None
) -> list[torch.Tensor]:
    """Each leaf concatenated along dim 0 over micro-batches, then over ranks in rank order
    (``all_gather``: ``[world, *shape]``; None: one rank)."""
    rows = 0 if padded else len(results)
    local = [
        torch.cat([row[i] for row in results[:rows]]) if rows else results[0][i][:0]
        for i in range(len(results[0]))
    ]
    if all_gather is None:
        return local
    sizes = torch.tensor([float(t.shape[0]) for t in local], dtype=torch.float64)
    every = [[int(x) for x in r] for r in all_gather(sizes).tolist()]
    out = []
    for i, t in enumerate(local):
        most = max(r[i] for r in every)
        buf = t.new_zeros((most, *t.shape[1:]))
        buf[: t.shape[0]] = t
        gathered = all_gather(buf)
        out.append(torch.cat([gathered[r, : every[r][i]] for r in range(len(every))]))
    return out


def reduce_results(
    results: list[list[torch.Tensor]],
    rebuild: Any,
    reduce: str,
    *,
    padded: bool,
    all_reduce_sum: Reduce,
    all_gather: Reduce | None,
) -> Any:
    """The statistic in ``fn``'s layout: summed (a rank with padding only sums zeros) or
    concatenated (``padded``: this rank holds only padding, so it adds no rows)."""
    if reduce == "sum":
        return rebuild(_sum(results, all_reduce_sum))
    return rebuild(_cat(results, padded, all_gather))

"""What every DeepSpeed route shares: what cannot be exact, the scale up front, the close.

DeepSpeed divides each loss by ``gradient_accumulation_steps`` and, at ZeRO 2/3, reduces and
partitions gradients during backward, so every fullbatch route on it (``ExactEngine``, the
Trainer and TRL wings) counts the window first and backpropagates ``loss_sum · W / N`` with
``scale_wrt_gas=False`` (:func:`window_scale`, :func:`scaled`). :func:`close_engine_window`
ends it: ZeRO 1-3 step (a skipped window's NaN scale makes DeepSpeed's overflow check skip);
stage 0 reads the gradients first and clears a skipped window. :func:`refusal` (from the floor,
``fullbatch._base._deepspeed``, where the probe reads it too) names what no scale can make exact.
:func:`engine_stats` is a window statistic's pre-pass on the engine (``fullbatch._base._prepass``
with the engine's ranks; at ZeRO-3 every rank runs the same number of forwards).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from fullbatch._base._deepspeed import OFFLOAD_FIXED, installed_version, refusal
from fullbatch._base._prepass import StatsFn, reduce_results, run_pass
from fullbatch._base._sync import gather_over_ranks, sum_over_ranks
from fullbatch._base._verdict import Verdict, WindowTotals
from fullbatch._wings._close import Wing, close_window
from fullbatch._wings._window import WingWindow, count_ahead

__all__ = [
    "OFFLOAD_FIXED",
    "check_engine",
    "close_engine_window",
    "engine_stats",
    "installed_version",
    "refusal",
    "scaled",
    "window_scale",
]


def check_engine(engine: Any, micro_batches: int, version: str | None = None) -> None:
    """Raise ``ValueError`` for an engine whose step cannot be made exact (:func:`refusal`).

    ``micro_batches``: backward calls per optimizer step; ``version``: deepspeed's (default:
    the installed one).
    """
    why = refusal(
        stage=int(engine.zero_optimization_stage()),
        offload=bool(engine.zero_use_cpu_optimizer()),  # offload_optimizer: cpu or nvme
        micro_batches=micro_batches,
        version=installed_version() if version is None else version,
        moe=bool(getattr(engine, "has_moe_layers", False)),
        sequence_parallel=getattr(engine, "seq_dp_world_size", engine.dp_world_size)
        != engine.dp_world_size,
        half=bool(engine.fp16_enabled() or engine.bfloat16_enabled()),
    )
    if why is not None:
        raise ValueError(f"fullbatch cannot make this DeepSpeed step exact: {why}.")


def window_scale(
    counts: list[float],
    reduce: Callable[[torch.Tensor], torch.Tensor] | None,
    world: int,
    device: Any,
) -> tuple[float, float]:
    """``(N, W / N)``: ``counts`` (this rank's micro-batches) summed over the ranks by
    ``reduce`` (``None`` on one process); the scale is NaN when ``N = 0`` (a skip).

    >>> window_scale([3, 5], None, 2, "cpu")
    (8.0, 0.25)
    """
    n = count_ahead([sum(counts)], reduce, device).sums[0]
    return n, (world / n if n > 0 else math.nan)


def scaled(loss_sum: torch.Tensor, scale: float) -> torch.Tensor:
    """``loss_sum · scale``, or NaN times it when the loss is not finite (DeepSpeed skips).

    >>> scaled(torch.tensor(float("inf")), 0.5).isnan().item()
    True
    """
    loss = loss_sum.detach()
    factor = torch.where(torch.isfinite(loss), scale, math.nan).to(loss_sum.dtype)
    return loss_sum * factor


def close_engine_window(
    engine: Any,
    wing: Wing,
    window: WingWindow,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None,
    *,
    count: float,
    loss_divisor: float,
    stepped: bool = False,
    ran: bool = True,
    skip: Callable[[Verdict], None] | None = None,
) -> tuple[Verdict, list[float]]:
    """Step the engine (or clear a skipped stage-0 window) and close the window.

    ``window``: the wing window, its sums summed over the ranks by ``reduce``. ``count``: the
    window's ``N`` (all ranks); ``loss_divisor``: what the summed loss is divided by to give the
    window's loss (``N``, or ``W`` for shares). ``stepped``: Accelerate's backward has stepped
    the engine already (ZeRO 1-3 only); ``ran``: a backward ran (a window without items may run
    none); ``skip``: what the wing's framework needs on a skip besides DeepSpeed's (the Trainer
    steps its LR scheduler regardless). Returns the verdict and ``[loss, count, *extras]``.
    """
    stage0 = int(engine.zero_optimization_stage()) == 0
    if stage0 and stepped:
        raise RuntimeError("a ZeRO stage 0 engine was stepped before the window's verdict.")
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None] if stage0 else []
    read = window.read(grads, reduce)
    values, sq = read.values, read.squared_norm
    applied = False
    if ran and not stage0:
        if not stepped:
            engine.step()
        applied = bool(engine.was_step_applied())
        norm = engine.get_global_grad_norm()
        sq = math.inf if norm is None else float(norm) ** 2
    elif ran and count > 0 and math.isfinite(sq) and math.isfinite(values[0]):
        engine.step()
        applied = True
    elif ran:  # stage 0: DeepSpeed would apply a non-finite gradient
        engine.zero_grad()
    totals = WindowTotals(
        loss=values[0] / loss_divisor if count > 0 else 0.0,
        count=count,
        squared_norm=sq,
        share=True,  # the losses were scaled to the window's share before backward
    )
    verdict = close_window(totals, wing, skip=skip)
    if ran and verdict.skipped == applied:
        raise RuntimeError(
            f"DeepSpeed {'applied' if applied else 'skipped'} a step that fullbatch's verdict "
            f"{'skips' if verdict.skipped else 'takes'} ({verdict.reason}); please report this "
            "with your DeepSpeed config."
        )
    return verdict, values


#: why a ZeRO-3 pre-pass does not halve, and the fix (an OOM error names it)
ZERO3_GATHERS = (
    "whose forwards run ZeRO-3's parameter all-gathers on every rank, so it cannot re-run "
    "one rank's micro-batch in halves: give the loader micro-batches whose no-grad forward fits"
)


def engine_stats(engine: Any, micros: list[Any], most: int, fn: StatsFn, reduce: str) -> Any:
    """``fn`` on this rank's ``micros`` without gradients, reduced over the engine's ranks.

    At ZeRO-3 every forward all-gathers the partitioned parameters on every rank, so a rank
    holding fewer than ``most`` micro-batches also runs its padding ones (its last micro-batch
    again, as the window yields it; the results dropped), and an out-of-memory error is not
    retried in halves. Below ZeRO-3 forwards run no collective: real micro-batches only.
    """
    gathers = int(engine.zero_optimization_stage()) == 3
    padding = most - len(micros) if gathers else 0
    run = [(m, False) for m in micros] + [(micros[-1], True)] * padding
    results, rebuild = run_pass(
        fn, run, engine.module, split=not gathers, collectives=ZERO3_GATHERS
    )
    device = engine.device
    return reduce_results(
        results,
        rebuild,
        reduce,
        padded=False,  # every rank holds a real micro-batch (DeepSpeedWindow checks)
        all_reduce_sum=lambda t: sum_over_ranks(t.to(device)).to(t.device),
        all_gather=lambda t: gather_over_ranks(t.to(device)).to(t.device),
    )

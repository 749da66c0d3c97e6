"""The step, in DESIGN.md's one order.

all-reduce (loss sum, count, flags) → unscale (GradScaler) → normalize → clip (report the
pre-clip norm) → optimizer step (skip on zero items or non-finite values) → scaler update →
scheduler step → ``zero_grad(set_to_none=True)``. Whether and by how much to step is
:func:`fullbatch._base._verdict.decide`, as in every wing. Its inputs are read from the device
once (:mod:`fullbatch._engine._read`): one host synchronization per window.
"""

from __future__ import annotations

import math

from fullbatch._base._normalize import scale_grads, squared_norm
from fullbatch._base._stats import StepStats
from fullbatch._base._verdict import NONFINITE_GRADIENT, WindowTotals, decide
from fullbatch._engine._core import Engine
from fullbatch._engine._open import end_window
from fullbatch._engine._read import WindowNumbers, pair_discard, read_numbers
from fullbatch._engine._state import Phase, WindowState

__all__ = ["discard_window", "step_window"]


def _lr(engine: Engine, numbers: WindowNumbers) -> float | None:
    if not math.isnan(numbers.lr):  # a tensor learning rate, read with the window's numbers
        return numbers.lr
    groups = engine.optimizer.param_groups
    return float(groups[0]["lr"]) if groups and "lr" in groups[0] else None


def step_window(engine: Engine, state: WindowState) -> StepStats:
    if engine.guard.scheduler_moved():
        end_window(engine, state, Phase.ABANDONED)
        raise RuntimeError(engine.guard.scheduler_message())
    leftover = engine.prepared.step_message(state.index)
    if leftover is not None:  # Accelerate's accumulate() would have un-synced this window
        end_window(engine, state, Phase.ABANDONED)
        raise RuntimeError(leftover)
    sync = engine.sync
    precision = engine.grad_buffers  # accumulate_dtype: the float32 buffers stand in for .grad
    if sync.reduce_at_step:
        if precision is not None:
            precision.reduce(sync)
        else:
            sync.reduce_gradients(engine.params)
    if precision is not None:
        grads = precision.grads()
    else:
        grads = [p.grad for p in engine.params if p.grad is not None]
    # Context parallelism sums gradients over its ranks after this read (which must come
    # first: a rank that discarded the window pairs with the read's collective only), so its
    # norm is a second read, below.
    combined_later = sync.context_group is not None
    numbers = read_numbers(engine, state, grads, norm=not combined_later)
    if numbers.discarded:
        end_window(engine, state, Phase.ABANDONED)
        raise RuntimeError(
            f"window {state.index} was discarded on {int(numbers.discarded)} rank(s) but "
            "stepped on this one; window.discard() is collective: call it on every rank."
        )
    if numbers.bad_counts:
        end_window(engine, state, Phase.ABANDONED)
        raise ValueError(
            f"a count passed to window.backward in window {state.index} was negative or "
            "non-finite (a device tensor, checked at step()). The window was discarded; "
            "counts must be finite numbers >= 0."
        )
    if numbers.share_calls and numbers.count_calls:
        end_window(engine, state, Phase.ABANDONED)
        raise ValueError(
            f"in window {state.index} some ranks called backward(loss, count) and others "
            "backward(share); use one form on every rank."
        )
    sq = numbers.squared_norm(sync.sharded)
    if combined_later:
        # CP ranks beside the wrapper: sum their pieces (zeros here change neither norm nor
        # scale).
        sync.combine_context_parallel(engine.params, grads if precision is not None else None)
        if not sync.sharded:
            sq = float(squared_norm(grads, engine.stat_device)) / numbers.scale**2
    share = numbers.share_calls > 0
    count = numbers.count
    plan = engine.step_plan
    scaler = plan.scaler
    loss_scale = 1.0 if share else state.loss_scale
    # The divisor W undoes the wrapper's average over ranks; c·N is the window's normalizer.
    verdict = decide(
        WindowTotals(
            loss=numbers.loss,
            count=None if share else count,
            squared_norm=sq,
            divisor=sync.divisor,
            loss_scale=loss_scale,
            max_grad_norm=plan.max_grad_norm,
            share=share,
        )
    )
    engine.verdict = verdict  # published: fb.probe reads the clip folded into the multiply
    if scaler is not None:
        # On the device: divides by the scale and records the non-finite check that
        # scaler.update() consumes. It found nothing when the verdict steps (a non-finite
        # gradient makes the norm non-finite), so the optimizer steps directly: scaler.step()
        # would read that check on the host, a second synchronization.
        scaler.unscale_(engine.optimizer)
    lr = _lr(engine, numbers)
    if not verdict.skipped:
        if engine.window_hooks:  # the hooks see normalized, unclipped gradients
            scale_grads(grads, verdict.factor)
            if precision is not None:
                precision.write_back()
            engine.window_hooks.run()
            scale_grads([p.grad for p in engine.params if p.grad is not None], verdict.clip)
        else:  # the rescale folds into the clip multiply
            scale_grads(grads, verdict.factor * verdict.clip)
            if precision is not None:
                precision.write_back()  # cast once, after normalizing and clipping in float32
        engine.guard.stepping = True
        try:
            engine.optimizer.step()
        finally:
            engine.guard.stepping = False
        engine.counters.stepped()
    else:
        engine.counters.skipped(
            state.index,
            str(verdict.reason),
            report="acc.skipped_windows and stats.skipped_windows",
            scaler=scaler is not None,
        )
    if scaler is not None:
        if verdict.reason == NONFINITE_GRADIENT and sync.sharded:
            # Each rank's scaler saw only its shard: back off the same way everywhere.
            scaler.update(numbers.scale * scaler.get_backoff_factor())
        else:
            scaler.update()
    if not verdict.skipped and plan.scheduler is not None:
        plan.scheduler.step()
        engine.guard.scheduler_stepped()
    end_window(engine, state, Phase.SKIPPED if verdict.skipped else Phase.STEPPED)
    if verdict.next_loss_scale is not None:
        engine.loss_scale = verdict.next_loss_scale  # the next window's c: ≈ 1 / N, exact
    return StepStats(
        loss=verdict.loss,
        count=math.nan if share else count,
        grad_norm=verdict.grad_norm,
        skipped=verdict.skipped,
        reason=verdict.reason,
        steps=engine.counters.steps,
        loss_scale=loss_scale,
        lr=lr,
        micro_batches=state.yielded,
        totals=dict(state.totals or {}),
        skipped_windows=engine.counters.skipped_windows,
        stats_seconds=state.stats_seconds,
    )


def discard_window(engine: Engine, state: WindowState) -> None:
    """``window.discard()``: end the window; under DDP/FSDP2 pair with the others' step."""
    state.feed.fill()  # the window's unread micro-batches go with it: boundaries stay put
    end_window(engine, state, Phase.DISCARDED)
    if engine.sync.step_group is not None:
        pair_discard(engine)  # pairs with the others' step or discard

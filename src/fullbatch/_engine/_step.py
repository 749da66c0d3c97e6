"""The step, in DESIGN.md's one order.

all-reduce (loss sum, count, flags) → unscale (GradScaler) → normalize → clip (report the
pre-clip norm) → optimizer step (skip on zero items or non-finite values) → scaler update →
scheduler step → ``zero_grad(set_to_none=True)``. Whether and by how much to step is
:func:`fullbatch._base._verdict.decide`, as in every wing.
"""

from __future__ import annotations

import math

import torch

from fullbatch._base._normalize import accumulation_dtype, scale_grads, squared_norm
from fullbatch._base._stats import StepStats
from fullbatch._base._verdict import NONFINITE_GRADIENT, WindowTotals, decide
from fullbatch._engine._core import Engine
from fullbatch._engine._open import end_window
from fullbatch._engine._state import Phase, WindowState

__all__ = ["discard_window", "step_window"]

# Slots of the one small all-reduce at the step.
_LOSS, _COUNT, _BAD_COUNT, _SHARD_SQ, _DISCARDED, _SHARE_CALLS, _COUNT_CALLS = range(7)


def _reduce_stats(
    engine: Engine, state: WindowState | None, grads: list[torch.Tensor]
) -> list[float]:
    """Sum the window's numbers over ranks: one collective, one host synchronization."""
    device = engine.stat_device
    dtype = accumulation_dtype(device)
    parts = [torch.zeros((), dtype=dtype, device=device) for _ in range(7)]
    if state is None:
        parts[_DISCARDED] += 1
    else:
        loss, counts, bad = state.sums(device, dtype)
        parts[_LOSS] = loss
        parts[_COUNT] = counts + state.count_py
        parts[_BAD_COUNT] = bad
        if engine.sync.sharded:
            # Ranks holding the same shard (HSDP replicas) each add their share.
            parts[_SHARD_SQ] = squared_norm(grads, device) / engine.sync.norm_copies
        # The form is agreed over ranks: a rank without micro-batches made no call at all.
        form_slot = _SHARE_CALLS if state.form == "share" else _COUNT_CALLS
        parts[form_slot] += state.backwards
    if engine.sync.group is None:
        return torch.stack(parts).tolist()
    return engine.sync.all_reduce_sum(torch.stack(parts)).tolist()


def _lr(engine: Engine) -> float | None:
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
    precision = engine.precision  # accumulate_dtype: the float32 buffers stand in for .grad
    if sync.reduce_at_step:
        if precision is not None:
            precision.reduce(sync)
        else:
            sync.reduce_gradients(engine.params)
    if precision is not None:
        grads = precision.grads()
    else:
        grads = [p.grad for p in engine.params if p.grad is not None]
    loss_total, count, bad, shard_sq, discarded, shares, counted = _reduce_stats(
        engine, state, grads
    )
    if discarded:
        end_window(engine, state, Phase.ABANDONED)
        raise RuntimeError(
            f"window {state.index} was discarded on {int(discarded)} rank(s) but stepped on "
            "this one; window.discard() is collective: call it on every rank."
        )
    if bad:
        end_window(engine, state, Phase.ABANDONED)
        raise ValueError(
            f"a count passed to window.backward in window {state.index} was negative or "
            "non-finite (a device tensor, checked at step()). The window was discarded; "
            "counts must be finite numbers >= 0."
        )
    if shares and counted:
        end_window(engine, state, Phase.ABANDONED)
        raise ValueError(
            f"in window {state.index} some ranks called backward(loss, count) and others "
            "backward(share); use one form on every rank."
        )
    # CP ranks beside the wrapper: sum their pieces (zeros here do not change norm or scale).
    sync.combine_context_parallel(engine.params, grads if precision is not None else None)
    share = shares > 0
    scaler = engine.scaler
    loss_scale = 1.0 if share else state.loss_scale
    grad_scale = 1.0
    if scaler is not None:
        grad_scale = float(scaler.get_scale())
        scaler.unscale_(engine.optimizer)
    if sync.sharded:
        sq = shard_sq / grad_scale**2
    else:
        sq = float(squared_norm(grads, engine.stat_device)) if grads else 0.0
    # The divisor W undoes the wrapper's average over ranks; c·N is the window's normalizer.
    verdict = decide(
        WindowTotals(
            loss=loss_total,
            count=None if share else count,
            squared_norm=sq,
            divisor=sync.divisor,
            loss_scale=loss_scale,
            max_grad_norm=engine.max_grad_norm,
            share=share,
        )
    )
    lr = _lr(engine)
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
            if scaler is not None:
                scaler.step(engine.optimizer)
            else:
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
            scaler.update(grad_scale * scaler.get_backoff_factor())
        else:
            scaler.update()
    if not verdict.skipped and engine.scheduler is not None:
        engine.scheduler.step()
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
    )


def discard_window(engine: Engine, state: WindowState) -> None:
    """``window.discard()``: end the window; under DDP/FSDP2 pair with the others' step."""
    state.feed.fill()  # the window's unread micro-batches go with it: boundaries stay put
    end_window(engine, state, Phase.DISCARDED)
    if engine.sync.group is not None:
        _reduce_stats(engine, None, [])  # pairs with the others' step or discard

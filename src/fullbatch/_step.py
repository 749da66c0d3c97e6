"""The step, in DESIGN.md's one order.

all-reduce (loss sum, count, flags) → unscale (GradScaler) → normalize → clip (report the
pre-clip norm) → optimizer step (skip on zero items or non-finite values) → scaler update →
scheduler step → ``zero_grad(set_to_none=True)``.
"""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING

import torch

from fullbatch._normalize import accumulation_dtype, power_of_two_scale, scale_grads, squared_norm
from fullbatch._stats import StepStats

if TYPE_CHECKING:
    from fullbatch._accumulator import Accumulator
    from fullbatch._window import Window

__all__ = ["abandon_window", "discard_window", "step_window"]

# Slots of the one small all-reduce at the step.
_LOSS, _COUNT, _BAD_COUNT, _SHARD_SQ, _DISCARDED, _SHARE_CALLS, _COUNT_CALLS = range(7)


def _reduce_stats(
    acc: Accumulator, window: Window | None, grads: list[torch.Tensor]
) -> list[float]:
    """Sum the window's numbers over ranks: one collective, one host synchronization."""
    device = acc._stat_device
    dtype = accumulation_dtype(device)
    parts = [torch.zeros((), dtype=dtype, device=device) for _ in range(7)]
    if window is None:
        parts[_DISCARDED] += 1
    else:
        loss, counts, bad = window._sums(device, dtype)
        parts[_LOSS] = loss
        parts[_COUNT] = counts + window._count_py
        parts[_BAD_COUNT] = bad
        if acc._sync.sharded:
            # Ranks holding the same shard (HSDP replicas, CP ranks) each add their share.
            parts[_SHARD_SQ] = squared_norm(grads, device) / acc._sync.norm_copies
        # The form is agreed over ranks: a rank without micro-batches made no call at all.
        form_slot = _SHARE_CALLS if window._form == "share" else _COUNT_CALLS
        parts[form_slot] += window._backwards
    if acc._sync.group is None:
        return torch.stack(parts).tolist()
    return acc._sync.all_reduce_sum(torch.stack(parts)).tolist()


def _lr(acc: Accumulator) -> float | None:
    groups = acc.optimizer.param_groups
    return float(groups[0]["lr"]) if groups and "lr" in groups[0] else None


def step_window(acc: Accumulator, window: Window) -> StepStats:
    if acc._guard.scheduler_moved():
        abandon_window(acc)
        raise RuntimeError(acc._guard.scheduler_message())
    leftover = acc._prepared.step_message(window.index)
    if leftover is not None:  # Accelerate's accumulate() would have un-synced this window
        abandon_window(acc)
        raise RuntimeError(leftover)
    sync = acc._sync
    precision = acc._precision  # accumulate_dtype: the float32 buffers stand in for .grad
    if sync.reduce_at_step:
        if precision is not None:
            precision.reduce(sync)
        else:
            sync.reduce_gradients(acc._params)
    if precision is not None:
        grads = precision.grads()
    else:
        grads = [p.grad for p in acc._params if p.grad is not None]
    loss_total, count, bad, shard_sq, discarded, shares, counted = _reduce_stats(acc, window, grads)
    if discarded:
        abandon_window(acc)
        raise RuntimeError(
            f"window {window.index} was discarded on {int(discarded)} rank(s) but stepped on "
            "this one; window.discard() is collective: call it on every rank."
        )
    if bad:
        abandon_window(acc)
        raise ValueError(
            f"a count passed to window.backward in window {window.index} was negative or "
            "non-finite (a device tensor, checked at step()). The window was discarded; "
            "counts must be finite numbers >= 0."
        )
    if shares and counted:
        abandon_window(acc)
        raise ValueError(
            f"in window {window.index} some ranks called backward(loss, count) and others "
            "backward(share); use one form on every rank."
        )
    # CP ranks beside the wrapper: sum their pieces (zeros here do not change norm or scale).
    sync.combine_context_parallel(acc._params, grads if precision is not None else None)
    share = shares > 0
    scaler = acc._scaler
    loss_scale = 1.0 if share else window.loss_scale
    grad_scale = 1.0
    if scaler is not None:
        grad_scale = float(scaler.get_scale())
        scaler.unscale_(acc.optimizer)
    if sync.sharded:
        sq = shard_sq / grad_scale**2
    else:
        sq = float(squared_norm(grads, acc._stat_device)) if grads else 0.0
    # The divisor W undoes the wrapper's average over ranks; c·N is the window's normalizer.
    factor = sync.divisor if share else sync.divisor / (loss_scale * count) if count else 0.0
    grad_norm = math.sqrt(sq) * factor if math.isfinite(sq) else math.nan
    reason = None
    if not share and count == 0:
        reason, grad_norm = "no items counted in the window", math.nan
    elif not math.isfinite(loss_total):
        reason = "non-finite loss"
    elif not math.isfinite(sq):
        reason = "non-finite gradient"
    lr = _lr(acc)
    if reason is None:
        clip = 1.0
        if acc._max_grad_norm is not None:
            clip = min(1.0, acc._max_grad_norm / (grad_norm + 1e-6))
        if acc._window_hooks:  # the hooks see normalized, unclipped gradients
            scale_grads(grads, factor)
            if precision is not None:
                precision.write_back()
            acc._window_hooks.run()
            scale_grads([p.grad for p in acc._params if p.grad is not None], clip)
        else:
            scale_grads(grads, factor * clip)  # the rescale folds into the clip multiply
            if precision is not None:
                precision.write_back()  # cast once, after normalizing and clipping in float32
        acc._guard.stepping = True
        try:
            if scaler is not None:
                scaler.step(acc.optimizer)
            else:
                acc.optimizer.step()
        finally:
            acc._guard.stepping = False
        acc.steps += 1
    else:
        acc.skipped_windows += 1
        warn_skipped(acc, window.index, reason)
    if scaler is not None:
        if reason == "non-finite gradient" and sync.sharded:
            # Each rank's scaler saw only its shard: back off the same way everywhere.
            scaler.update(grad_scale * scaler.get_backoff_factor())
        else:
            scaler.update()
    if reason is None and acc._scheduler is not None:
        acc._scheduler.step()
        acc._guard.scheduler_stepped()
    acc._guard.end_window()
    acc._clear_grads()
    sync.finish_window()
    if acc._batchnorm is not None:
        acc._batchnorm.finish(apply=reason is None)
    if not share and count > 0:
        acc._loss_scale = power_of_two_scale(count)  # the next window's c: ≈ 1 / N, exact
    return StepStats(
        loss=loss_total / count if not share and count else (loss_total if share else math.nan),
        count=math.nan if share else count,
        grad_norm=grad_norm,
        skipped=reason is not None,
        reason=reason,
        steps=acc.steps,
        loss_scale=loss_scale,
        lr=lr,
        micro_batches=window._yielded,
        totals=dict(window._totals or {}),
        skipped_windows=acc.skipped_windows,
    )


def warn_skipped(acc: Accumulator, index: int, reason: str) -> None:
    """Warn about a skipped window: the 1st, 2nd, 4th, 8th, ... so a long run is not flooded."""
    n = acc.skipped_windows
    if n & (n - 1):
        return
    hint = (
        " With a GradScaler a few skips are expected while it calibrates its scale."
        if acc._scaler is not None and reason == "non-finite gradient"
        else ""
    )
    warnings.warn(
        f"window {index} was skipped ({reason}): parameters, optimizer and scheduler are "
        f"unchanged. {n} window(s) skipped so far, {acc.steps} stepped; stats.skipped and "
        f"stats.skipped_windows report every skip (this warning repeats at 1, 2, 4, 8, ... "
        f"skips).{hint}",
        RuntimeWarning,
        stacklevel=5,  # the user's window.step()
    )


def abandon_window(acc: Accumulator) -> None:
    """End a window without a step: no gradients, sync flags and BatchNorm statistics back."""
    acc._guard.end_window()
    acc._sync.end()
    acc._clear_grads()
    acc._sync.drop_unreduced_grads()  # FSDP2 keeps unsynced gradients outside param.grad
    acc._sync.finish_window()
    if acc._batchnorm is not None:
        acc._batchnorm.finish(apply=False)


def discard_window(acc: Accumulator, window: Window) -> None:
    abandon_window(acc)
    if acc._sync.group is not None:
        _reduce_stats(acc, None, [])  # pairs with the others' step or discard

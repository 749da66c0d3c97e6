"""The three gradients ``verify`` compares: full batch, fullbatch's Accumulator, naive ``loss / K``.

Each arm leaves every ``.grad`` at ``None`` and returns the gradients it produced, keyed by
parameter name. The fullbatch arm drives the real :class:`fullbatch.Accumulator`, so verify
exercises the library itself, never a re-implementation of it.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fullbatch._base._split import count_rows, take_rows
from fullbatch._engine._accumulator import Accumulator
from fullbatch._proof._norms import norm
from fullbatch._proof._objective import check_loss_output
from fullbatch._verify._recorder import GradientRecorder

__all__ = [
    "ArmResult",
    "LossFn",
    "call_loss",
    "compare",
    "full_batch_arm",
    "fullbatch_arm",
    "grad_norm",
    "naive_arm",
    "relative",
]

Grads = dict[str, torch.Tensor | None]
LossFn = Callable[[nn.Module, Any], tuple[torch.Tensor, Any]]


@dataclass
class ArmResult:
    """Gradients of one recipe, its loss, and (fullbatch only) what its step reported."""

    grads: Grads
    loss: float
    count: float
    reported_grad_norm: float | None = None
    skipped_reason: str | None = None
    loss_scale: float = 1.0
    warnings: list[str] = field(default_factory=list)


def call_loss(loss_fn: LossFn, model: nn.Module, batch: Any) -> tuple[torch.Tensor, float]:
    """Call ``loss_fn(model, batch)`` and check it returned ``(loss_sum, count)``."""
    return check_loss_output(loss_fn(model, batch))


def _take_grads(params: list[tuple[str, nn.Parameter]]) -> Grads:
    grads: Grads = {}
    for name, param in params:
        grads[name] = None if param.grad is None else param.grad.detach().clone()
        param.grad = None
    return grads


def full_batch_arm(
    model: nn.Module,
    params: list[tuple[str, nn.Parameter]],
    batch: Any,
    loss_fn: LossFn,
    *,
    scale_before: float | None = None,
) -> ArmResult:
    """The reference: ``loss_sum / count`` on the whole batch, one backward.

    With ``scale_before=c`` the backward runs on ``c * loss_sum`` and the gradient is divided
    by ``c * count`` afterwards, in float64, as fullbatch does: the same math, so the
    difference to the reference is the model's own rounding band (large when a float64 model
    computes partly in float32, or under autocast).
    """
    loss, count = call_loss(loss_fn, model, batch)
    mean = loss / count if count else loss * math.nan
    (mean if scale_before is None else loss * scale_before).backward()
    grads = _take_grads(params)
    if scale_before is not None:
        divisor = scale_before * count
        grads = {n: None if g is None else g.double() / divisor for n, g in grads.items()}
    return ArmResult(grads, float(mean.detach()), count)


def naive_arm(
    model: nn.Module,
    params: list[tuple[str, nn.Parameter]],
    batch: Any,
    loss_fn: LossFn,
    micro_batch_size: int,
) -> ArmResult:
    """The common mistake: each micro-batch's mean ``loss_sum / count``, divided by K."""
    rows = count_rows(batch)
    starts = range(0, rows, micro_batch_size)
    total, count = 0.0, 0.0
    for start in starts:
        micro = take_rows(batch, start, start + micro_batch_size)
        loss, n = call_loss(loss_fn, model, micro)
        share = (loss / n if n else loss * math.nan) / len(starts)
        share.backward()
        total += float(share.detach())
        count += n
    return ArmResult(_take_grads(params), total, count)


def fullbatch_arm(
    model: nn.Module,
    params: list[tuple[str, nn.Parameter]],
    batch: Any,
    loss_fn: LossFn,
    micro_batch_size: int,
    share: Any = None,
) -> ArmResult:
    """One window of the real ``fb.Accumulator`` over ``batch``; the step records gradients.

    With ``share`` (a ``ShareForm``): ``counts=`` on the Accumulator and
    ``window.backward(share)`` with the share computed from ``window.totals``.
    """
    recorder = GradientRecorder([p for _, p in params])
    stats = None
    counts = None if share is None else share.counts
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc = Accumulator(model, recorder, micro_batch_size=micro_batch_size, counts=counts)
        try:
            for window in acc.windows([batch]):
                if stats is not None:
                    raise RuntimeError("fb.Accumulator made two windows out of one batch")
                for micro in window:
                    if share is not None:
                        window.backward(share.share(model, micro, window.totals))
                        continue
                    loss, count = call_loss(loss_fn, model, micro)
                    window.backward(loss, count)
                stats = window.step()
        finally:
            acc.close()
    if stats is None:
        raise RuntimeError("fb.Accumulator made no window out of one batch")
    notes = [f"fullbatch warned: {w.message}" for w in caught]
    if stats.skipped or recorder.recorded is None:
        grads: Grads = {name: None for name, _ in params}
        reason = stats.reason or "no optimizer step"
        return ArmResult(
            grads, stats.loss, stats.count, stats.grad_norm, reason, stats.loss_scale, notes
        )
    grads = {name: g for (name, _), g in zip(params, recorder.recorded, strict=True)}
    return ArmResult(grads, stats.loss, stats.count, stats.grad_norm, None, stats.loss_scale, notes)


def grad_norm(grads: Grads) -> float:
    """Total 2-norm of all gradients, in float64 (a chunk at a time)."""
    return norm(list(grads.values()))


def relative(value: float, reference: float) -> float:
    """``|value - reference| / |reference|`` (0 when both are 0, inf when only the latter)."""
    if math.isnan(value) or math.isnan(reference):
        return math.nan
    diff = abs(value - reference)
    if reference == 0:
        return 0.0 if diff == 0 else math.inf
    return diff / abs(reference)


#: a tensor's error is relative to at least this fraction of the whole gradient's RMS entry
#: (measured: float32 rounding on a bias before BatchNorm, whose gradient is ~0 by construction,
#: is ~4e-6 of the RMS entry; 1e-3 of it made that a 4e-3 "error")
FLOOR = 1.0


def compare(reference: Grads, got: Grads) -> tuple[float, str | None, float]:
    """``(worst tensor's max|Δ|/max(max|ref|, floor), its name, ‖Δ‖/‖ref‖)`` in float64.

    The per-tensor measure keeps a wrong small tensor (a bias) from hiding behind large
    ones; its denominator has a floor, the whole reference gradient's RMS entry
    (``‖ref‖ / sqrt(numel)``), so a tensor whose gradient is ~0 by construction (BERT's
    attention key bias: the softmax ignores it; a bias before BatchNorm) is judged on its
    rounding relative to the rest of the gradient, not relative to its own rounding noise. A
    100% error on a tensor 100 times smaller than the RMS entry still reads 1e-2.

    >>> ref = {"w": torch.tensor([2.0, 0.0]), "b": torch.tensor([0.0])}
    >>> got = {"w": torch.tensor([2.0, 0.5]), "b": torch.tensor([0.0])}
    >>> worst, name, overall = compare(ref, got)
    >>> worst, name, round(overall, 4)
    (0.25, 'w', 0.25)
    """
    ref_sq = sum(float(r.double().pow(2).sum()) for r in reference.values() if r is not None)
    numel = sum(r.numel() for r in reference.values() if r is not None)
    floor = FLOOR * math.sqrt(ref_sq / numel) if numel else 0.0
    worst, worst_name, diff_sq = 0.0, None, 0.0
    for name, ref in reference.items():
        new = got.get(name)
        if ref is None and new is None:
            continue
        if ref is None:
            assert new is not None
            ref64 = torch.zeros_like(new, dtype=torch.float64)
        else:
            ref64 = ref.double()
        new64 = torch.zeros_like(ref64) if new is None else new.double()
        diff = (new64 - ref64).abs()
        max_diff = float(diff.max()) if diff.numel() else 0.0
        denom = max(float(ref64.abs().max()) if ref64.numel() else 0.0, floor)
        error = max_diff / denom if denom > 0 else (0.0 if max_diff == 0 else math.inf)
        if math.isnan(error) or (not math.isnan(worst) and error > worst):
            worst, worst_name = error, name
        diff_sq += float(diff.pow(2).sum())
    if ref_sq > 0:
        global_error = math.sqrt(diff_sq) / math.sqrt(ref_sq)
    else:
        global_error = 0.0 if diff_sq == 0 else (math.nan if math.isnan(diff_sq) else math.inf)
    return worst, worst_name, global_error

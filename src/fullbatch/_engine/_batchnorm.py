"""BatchNorm under accumulation: a warning, or exact window-level running statistics.

A BatchNorm layer in training mode normalizes each micro-batch with that micro-batch's
statistics (so the *gradient* is not the full batch's: fullbatch cannot change that) and
updates its running statistics once per micro-batch (so after a window they differ from one
full-batch update). ``batchnorm="window"`` fixes the second: it records each micro-batch's
input statistics, and at the step sets the running statistics to one update with the
statistics of the whole window, as a full-batch forward would have done. This is exact for
a layer whose input does not come through another train-mode BatchNorm: a later one sees
inputs normalized per micro-batch, which no bookkeeping of statistics can undo.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fullbatch._base._warn import warn

__all__ = ["WindowBatchNorm", "warn_batchnorm"]


def _batchnorms(model: nn.Module) -> list[tuple[str, nn.modules.batchnorm._BatchNorm]]:
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats
    ]


def _stats(m: nn.modules.batchnorm._BatchNorm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """running_mean, running_var, num_batches_tracked (present: track_running_stats is on)."""
    mean, var, tracked = m.running_mean, m.running_var, m.num_batches_tracked
    assert mean is not None and var is not None and tracked is not None
    return mean, var, tracked


def warn_batchnorm(model: nn.Module, *, window_statistics: bool = False) -> None:
    """Warn when the model has train-mode BatchNorm layers: the gradient is not exact.

    ``batchnorm="window"`` (``window_statistics``) fixes running statistics only, and only for
    layers whose input does not pass through another train-mode BatchNorm, so the warning
    stays, worded for it.
    """
    names = [name for name, m in _batchnorms(model) if m.training]
    if not names:
        return
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    gradient = (
        f"the model has {len(names)} BatchNorm layer(s) in training mode ({shown}): each "
        "micro-batch is normalized with its own statistics, so the gradient is NOT the full "
        "batch's (no accumulation can change that)."
    )
    if window_statistics:
        stats = (
            " batchnorm='window' makes running statistics equal to one full-batch update only "
            "for BatchNorm layers whose input does not pass through another train-mode "
            "BatchNorm (in a ResNet, the stem alone); later layers see inputs normalized per "
            "micro-batch and stay approximate."
        )
    else:
        stats = (
            " Running statistics also update once per micro-batch: batchnorm='window' makes "
            "them exact for BatchNorm layers not fed by another train-mode BatchNorm."
        )
    warn(gradient + stats + " For an exact step use GroupNorm/LayerNorm or eval-mode BatchNorm.")


class _Moments:
    """Per-channel count, mean and M2 over micro-batches (Chan's parallel combination)."""

    def __init__(self) -> None:
        self.n = 0.0
        self.mean: torch.Tensor | None = None
        self.m2: torch.Tensor | None = None

    def add(self, x: torch.Tensor) -> None:
        dims = [d for d in range(x.dim()) if d != 1]
        x = x.detach().to(torch.float64)
        n = float(x.numel() // x.shape[1])
        if n == 0:
            return
        mean = x.mean(dim=dims)
        m2 = ((x - mean.view(1, -1, *([1] * (x.dim() - 2)))) ** 2).sum(dim=dims)
        if self.mean is None or self.m2 is None:
            self.n, self.mean, self.m2 = n, mean, m2
            return
        total = self.n + n
        delta = mean - self.mean
        self.mean = self.mean + delta * (n / total)
        self.m2 = self.m2 + m2 + delta**2 * (self.n * n / total)
        self.n = total


class WindowBatchNorm:
    """Window-level running statistics for every BatchNorm layer of a model."""

    def __init__(self, model: nn.Module) -> None:
        self._layers = _batchnorms(model)
        self._moments: dict[str, _Moments] = {}
        self._saved: dict[str, tuple[torch.Tensor, ...]] = {}
        self._handles = [m.register_forward_pre_hook(self._hook(name)) for name, m in self._layers]

    def _hook(self, name: str) -> Any:
        def record(module: nn.Module, args: tuple[Any, ...]) -> None:
            if module.training and torch.is_grad_enabled() and name in self._saved:
                self._moments.setdefault(name, _Moments()).add(args[0])

        return record

    def start(self) -> None:
        self._moments = {}
        self._saved = {name: tuple(b.clone() for b in _stats(m)) for name, m in self._layers}

    def finish(self, apply: bool) -> None:
        """Restore the window-start statistics, then (if ``apply``) make one window update."""
        for name, m in self._layers:
            if name not in self._saved:
                continue
            mean0, var0, tracked0 = self._saved[name]
            mean, var, tracked = _stats(m)
            with torch.no_grad():
                mean.copy_(mean0)
                var.copy_(var0)
                tracked.copy_(tracked0)
                moments = self._moments.get(name)
                if not apply or moments is None or moments.mean is None or moments.m2 is None:
                    continue
                tracked.add_(1)
                momentum = m.momentum
                if momentum is None:  # cumulative moving average
                    momentum = 1.0 / float(tracked)
                unbiased = moments.m2 / max(moments.n - 1.0, 1.0)
                mean.mul_(1 - momentum).add_(momentum * moments.mean.to(mean0.dtype))
                var.mul_(1 - momentum).add_(momentum * unbiased.to(var0.dtype))
        self._saved = {}
        self._moments = {}

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

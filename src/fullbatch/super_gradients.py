"""Exact gradient accumulation inside Super-Gradients' own ``Trainer(batch_accumulate=K)``.

Super-Gradients (3.7.1) backpropagates each micro-batch's loss as it is and steps when
``global_step % batch_accumulate == 0``, ``global_step`` counting micro-batches across epochs:
every step is the *sum* of K per-micro-batch means (K times the full batch's gradient, and
micro-batches weigh the same whatever they hold, e.g. however many pixels are
``ignore_index``), windows run across epoch boundaries, and the last, partial window of a
training is never applied. This module keeps its Trainer (callbacks, loggers, checkpoints,
EMA) and makes every optimizer step the full-batch step over the window's micro-batches:

- :class:`SummedLoss` is the criterion: ``fn(outputs, targets) -> (loss_sum, count)``, the loss
  *summed* over the micro-batch's items and how many items that is. In a training forward it
  records both and returns ``c · loss_sum`` for SG to backpropagate (``c``: a power of two
  ``<= 1/N``, as every fullbatch wing uses; validation runs under ``no_grad`` and records
  nothing);
- :class:`ExactTrainer` is SG's ``Trainer`` with its ``_backward_step`` replaced: a window ends
  after K micro-batches **and at the end of every epoch** (a shorter last window is normalized
  by its own count), through the verdict every fullbatch wing uses
  (:mod:`fullbatch._base._verdict`): the gradient is multiplied by ``1 / (c · N)`` before the
  ``on_train_batch_gradient_step_start`` callbacks, SG's unscale and ``clip_grad_norm``; a
  window with no counted items, a non-finite loss or a non-finite gradient is skipped: no
  optimizer step, no EMA update, no step callbacks (step-based LR schedulers stay where they
  were), a ``RuntimeWarning``, counted in ``trainer.fb_counters``.

BatchNorm: a train-mode BatchNorm normalizes each micro-batch with its own statistics, so the
*gradient* is the micro-batches' (a warning says so); ``ExactTrainer(batchnorm="window")``
gives layers not fed by another train-mode BatchNorm exact window-level running statistics,
as ``fb.Accumulator(batchnorm="window")`` does. Learning rate: each step is the full-batch
step of the window's rows, so the learning rate tuned for that full batch is right as it is;
SG's own accumulation summed K means, so a recipe tuned on it used an effective SGD learning
rate K times its ``initial_lr``. To change the global batch size, ``fb.scale_lr``.

Refused: DDP and ``DataParallel`` (SG's DDP path needs CUDA and is not tested here: use
``fb.Accumulator`` with DDP), a criterion other than :class:`SummedLoss`, a non-dict
``training_params`` (convert an OmegaConf config with ``OmegaConf.to_container``).

Relies on these SG 3.7.1 internals: ``Trainer._backward_step(loss, epoch, batch_idx,
context)`` called once per micro-batch by ``_train_epoch``, the attributes ``scaler``,
``optimizer``, ``net``, ``train_loader``, ``max_train_batches``, ``max_epochs``, ``ema``,
``ema_model``, ``training_params`` and ``phase_callback_handler`` it reads there, and the
callback phases ``on_training_start`` / ``on_train_batch_start`` / ``on_training_end``.

Example (``benchmarks/super_gradients_exact.py`` runs it against a float64 full batch)::

    from fullbatch.super_gradients import ExactTrainer, SummedLoss

    def seg_loss(logits, targets):          # [B, C, H, W] logits, 255 = ignored pixel
        return fb.cross_entropy_sum(logits.movedim(1, -1), targets, ignore_index=255)

    trainer = ExactTrainer(experiment_name="seg", ckpt_root_dir=root, batchnorm="window")
    trainer.train(model=net, training_params={..., "loss": SummedLoss(seg_loss),
                  "batch_accumulate": 4}, train_loader=train, valid_loader=valid)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

try:
    from super_gradients.training import Trainer
    from super_gradients.training.utils.callbacks import Callback
except ImportError as exc:  # pragma: no cover - depends on what is installed
    raise ImportError(
        "fullbatch.super_gradients needs Super-Gradients 3.7.1, whose requirements pip cannot "
        "resolve: install it with --no-deps and its dependencies by hand, as "
        "docs/integrations_frameworks.md (Super-Gradients) shows."
    ) from exc

from fullbatch._base._normalize import check_count, power_of_two_scale, squared_norm
from fullbatch._base._verdict import NONFINITE_GRADIENT, Verdict, WindowCounters, WindowTotals
from fullbatch._base._warn import warn
from fullbatch._engine._batchnorm import WindowBatchNorm, warn_batchnorm
from fullbatch._wings._close import Wing, close_window

__all__ = ["ExactTrainer", "SummedLoss"]

# The frameworks between the user's trainer.train() and the window's end.
_THROUGH = ("super_gradients", "torch")
_BATCHNORM = (None, "window")


@dataclass
class _Window:
    """The open window: what :class:`SummedLoss` recorded in its training forwards."""

    k: int  # micro-batches per window (batch_accumulate)
    scale: float | None = None  # c; the first window's comes from its first micro-batch's count
    losses: list[torch.Tensor] = field(default_factory=list)  # Σ loss_sum per micro-batch
    counts: list[torch.Tensor] = field(default_factory=list)

    def record(self, loss_sum: torch.Tensor, count: Any) -> float:
        n = torch.as_tensor(count, dtype=torch.float64, device=loss_sum.device).detach()
        if self.scale is None:  # one host read, first window only: keeps fp16 sums in range
            self.scale = power_of_two_scale(float(n) * self.k)
        self.losses.append(loss_sum.detach().to(torch.float64).reshape(()))
        self.counts.append(n.reshape(()))
        return self.scale


class SummedLoss(nn.Module):
    """SG's criterion for :class:`ExactTrainer`: a summed loss and its item count.

    Args:
        fn: ``fn(outputs, targets) -> (loss_sum, count)``: the loss summed over the items the
            micro-batch holds (pixels, tokens, rows; ``ignore_index`` ones left out) and how
            many that is, e.g. ``fb.cross_entropy_sum``. ``count`` is a number or a 1-element
            tensor (a tensor on an accelerator is checked at the window's end).

    Returns ``(loss, logging_items)`` as SG's losses do: ``loss`` is ``c · loss_sum`` in a
    training forward (``loss_sum`` otherwise), ``logging_items`` the micro-batch's mean.

    Raises:
        ValueError: ``fn`` did not return ``(0-dim loss tensor, count)``, or a bad count.
        RuntimeError: a training forward outside :class:`ExactTrainer` (the stock Trainer
            would step on a sum: K times too large).

    >>> import torch
    >>> import fullbatch as fb
    >>> loss = SummedLoss(lambda logits, y: fb.cross_entropy_sum(logits, y, ignore_index=255))
    >>> with torch.no_grad():  # as SG validates
    ...     value, items = loss(torch.zeros(3, 4), torch.tensor([0, 255, 2]))
    >>> round(value.item(), 4), round(items.item(), 4)  # 2 · log 4, and its mean
    (2.7726, 1.3863)
    """

    def __init__(self, fn: Callable[[Any, Any], tuple[torch.Tensor, Any]]) -> None:
        super().__init__()
        if not callable(fn):
            raise ValueError(
                f"SummedLoss needs fn(outputs, targets) -> (loss_sum, count), got {fn!r}"
            )
        self.fn = fn
        self._window: _Window | None = None  # bound by ExactTrainer.train

    def forward(self, outputs: Any, targets: Any) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.fn(outputs, targets)
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], torch.Tensor)):
            raise ValueError(
                f"SummedLoss's fn must return (loss_sum, count), got {type(out).__name__}; "
                "e.g. return fb.cross_entropy_sum(logits, targets, ignore_index=255)."
            )
        loss_sum, count = out
        if loss_sum.numel() != 1:
            raise ValueError(f"loss_sum must be one number, got shape {tuple(loss_sum.shape)}")
        if isinstance(count, torch.Tensor) and count.numel() != 1:
            raise ValueError(f"count must be one number, got shape {tuple(count.shape)}")
        if not isinstance(count, torch.Tensor):
            check_count(count)
        n = torch.as_tensor(count, device=loss_sum.device).detach().to(loss_sum.dtype)
        mean = (loss_sum.detach() / n.clamp(min=1)).reshape(1)
        if not torch.is_grad_enabled():  # SG's validation and test: nothing to accumulate
            return loss_sum.reshape(()), mean
        if self._window is None:
            raise RuntimeError(
                "SummedLoss returns a summed loss: train with fullbatch.super_gradients."
                "ExactTrainer, which divides each window by its item count (SG's own Trainer "
                "would step on the sum)."
            )
        return loss_sum.reshape(()) * self._window.record(loss_sum, count), mean


class _WindowPhases(Callback):
    """The phases around the windows: checks at the start, BatchNorm snapshots, leftovers."""

    def __init__(self, window: _Window, batchnorm: str | None) -> None:
        self.window, self.batchnorm = window, batchnorm
        self.bn: WindowBatchNorm | None = None

    def on_training_start(self, context: Any) -> None:
        net = context.net
        if isinstance(net, nn.DataParallel | nn.parallel.DistributedDataParallel):
            raise ValueError(
                f"fullbatch.super_gradients runs in one process; the model is wrapped in "
                f"{type(net).__name__}. Train on one device, or use fb.Accumulator with DDP "
                "(docs/distributed.md), which counts items over every rank."
            )
        self.window.losses, self.window.counts = [], []
        warn_batchnorm(net, window_statistics=self.batchnorm == "window")
        if self.batchnorm == "window":
            self.bn = WindowBatchNorm(net)

    def on_train_batch_start(self, context: Any) -> None:
        if self.bn is not None and not self.window.losses:  # the window's first micro-batch
            self.bn.start()

    def end(self, apply: bool) -> None:
        if self.bn is not None:
            self.bn.finish(apply)

    def on_train_loader_end(self, context: Any) -> None:
        if self.window.losses:  # ExactTrainer ends a window at every epoch's last batch
            warn(
                f"{len(self.window.losses)} micro-batch(es) are still accumulated at the end of "
                "the epoch: the loader yielded fewer batches than len(train_loader), so this "
                "window runs into the next epoch (after the last one, it is never applied).",
                RuntimeWarning,
                through=_THROUGH,
            )

    def on_training_end(self, context: Any) -> None:
        if self.bn is not None:
            self.bn.close()
            self.bn = None


class ExactTrainer(Trainer):
    """SG's ``Trainer`` whose every optimizer step is the full-batch step of its window.

    Takes SG's arguments, plus ``batchnorm=None`` or ``"window"`` (exact window-level
    BatchNorm running statistics). ``train(...)`` takes SG's ``training_params`` dict with
    ``"loss": SummedLoss(fn)``; ``batch_accumulate`` is K (the epoch's last window may hold
    fewer micro-batches). ``trainer.fb_counters`` counts ``steps`` and ``skipped_windows``;
    ``trainer.fb_loss`` is the last window's ``Σ loss_sum / N``.

    Raises (from ``train``): ValueError for a criterion other than :class:`SummedLoss`, a
    ``batch_accumulate`` that is not a positive int, a ``training_params`` that is not a
    dict, a DDP or ``DataParallel`` model, a count that is negative or not finite.

    >>> ExactTrainer(experiment_name="seg", batchnorm="running")
    Traceback (most recent call last):
    ...
    ValueError: batchnorm must be None or 'window', got 'running'
    """

    fullbatch_route = "fullbatch.super_gradients.ExactTrainer"  # what fb.probe names it

    def __init__(self, *args: Any, batchnorm: str | None = None, **kwargs: Any) -> None:
        if batchnorm not in _BATCHNORM:
            raise ValueError(f"batchnorm must be None or 'window', got {batchnorm!r}")
        super().__init__(*args, **kwargs)
        self.fb_batchnorm = batchnorm
        self.fb_counters = WindowCounters()
        self.fb_loss = float("nan")
        self._fb: _WindowPhases | None = None

    def train(self, model: nn.Module, training_params: Any = None, *args: Any, **kw: Any) -> Any:
        params = {} if training_params is None else training_params
        if not isinstance(params, dict):
            raise ValueError(
                f"ExactTrainer.train needs training_params as a dict, got "
                f"{type(params).__name__}; convert a config with "
                "OmegaConf.to_container(cfg, resolve=True)."
            )
        loss, k = params.get("loss"), params.get("batch_accumulate", 1)
        if not isinstance(loss, SummedLoss):
            raise ValueError(
                f'ExactTrainer needs training_params["loss"] = SummedLoss(fn), got {loss!r}: '
                "fn(outputs, targets) returns the loss summed over the micro-batch's items and "
                "their count, e.g. fb.cross_entropy_sum(logits, targets, ignore_index=255)."
            )
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"batch_accumulate must be a positive int, got {k!r}")
        window = _Window(k)
        self._fb = _WindowPhases(window, self.fb_batchnorm)
        callbacks = [self._fb, *(params.get("phase_callbacks") or [])]
        loss._window = window
        try:
            return super().train(model, {**params, "phase_callbacks": callbacks}, *args, **kw)
        finally:
            loss._window = None

    def _backward_step(
        self, loss: torch.Tensor, epoch: int, batch_idx: int, context: Any, *args: Any, **kw: Any
    ) -> None:
        assert self._fb is not None, "ExactTrainer._backward_step outside train()"
        self.scaler.scale(loss).backward()
        self.phase_callback_handler.on_train_batch_backward_end(context)
        window = self._fb.window
        per_epoch = (
            len(self.train_loader) if self.max_train_batches is None else self.max_train_batches
        )
        if len(window.losses) < window.k and batch_idx + 1 < per_epoch:
            return  # the window goes on
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if not self._fb_end_window(params):
            return
        self.phase_callback_handler.on_train_batch_gradient_step_start(context)
        if self.training_params.clip_grad_norm:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(
                self.net.parameters(), self.training_params.clip_grad_norm
            )
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema:  # SG's own arguments: micro-batches so far, and in the whole training
            step = batch_idx + 1 + len(self.train_loader) * epoch
            self.ema_model.update(
                self.net, step=step, total_steps=len(self.train_loader) * self.max_epochs
            )
        self.phase_callback_handler.on_train_batch_gradient_step_end(context)

    def _fb_end_window(self, params: list[torch.Tensor]) -> bool:
        """Decide the window; normalize its gradient (True) or skip it (False)."""
        assert self._fb is not None
        window = self._fb.window
        grads = [p.grad for p in params if p.grad is not None]
        counts = torch.stack(window.counts)
        device = counts.device
        sums = torch.stack(
            [
                torch.stack(window.losses).to(device).sum(),
                counts.sum(),
                (~torch.isfinite(counts) | (counts < 0)).sum().to(torch.float64),
                squared_norm(grads, device).to(torch.float64),
            ]
        )
        loss, count, bad, sq = sums.tolist()  # the one host read per window
        if bad:
            raise ValueError(
                f"{int(bad)} count(s) in this window are negative or not finite "
                f"({counts.tolist()}): SummedLoss's fn must return the number of items its sum "
                "holds."
            )
        scaler = self.scaler.is_enabled()

        def skip(verdict: Verdict) -> None:
            if verdict.reason == NONFINITE_GRADIENT and scaler:
                self.scaler.step(self.optimizer)  # finds the inf, skips the optimizer, backs off
                self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)

        totals = WindowTotals(
            loss=loss, count=count, squared_norm=sq, loss_scale=window.scale or 1.0
        )
        wing = Wing(self.fb_counters, "trainer.fb_counters.skipped_windows", _THROUGH, scaler)
        verdict = close_window(totals, wing, grads, skip)
        window.losses, window.counts = [], []
        if verdict.next_loss_scale is not None:
            window.scale = verdict.next_loss_scale
        self._fb.end(apply=not verdict.skipped)
        self.fb_loss = verdict.loss
        return not verdict.skipped

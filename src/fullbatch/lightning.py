"""Exact gradient accumulation for Lightning's ``Trainer(accumulate_grad_batches=K)``.

Lightning divides every micro-batch's loss by ``K`` before backward. With a per-micro-batch
*mean* loss that is a mean of means (wrong whenever micro-batches hold different numbers of
tokens, Lightning#20350), and the epoch's last window of ``k < K`` micro-batches is still
divided by ``K`` (Lightning#19987). :class:`ExactAccumulation` makes each optimizer step the
full-batch step over the window's micro-batches (and all DDP ranks): ``training_step`` returns
the *summed* loss and its item count, and the callback rescales the accumulated gradient once
per window, in ``on_before_optimizer_step``, which Lightning calls after the GradScaler's
unscale and before gradient clipping; a window with no counted items or a non-finite loss or
gradient is skipped there, as ``fb.Accumulator`` skips it.

Example (the full, runnable version is in ``docs/integrations.md``)::

    class LM(pl.LightningModule):
        def training_step(self, batch, batch_idx):
            loss_sum, n = fb.causal_lm_loss(self.net(batch["input_ids"]), batch["labels"])
            return {"loss": loss_sum, "count": n}  # summed loss and its token count

    trainer = pl.Trainer(accumulate_grad_batches=4, callbacks=[ExactAccumulation()])
"""

from __future__ import annotations

import functools
import importlib
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

# The callback's base class and the type hints: the unified package first, then the
# standalone one. Lightning calls callbacks by their hook names, so either package's Trainer
# runs it; the strategies it checks against are the Trainer's own package's (_package).
try:
    import lightning.pytorch as pl
except ImportError:  # pragma: no cover - depends on what is installed
    try:
        import pytorch_lightning as pl  # type: ignore[no-redef]
    except ImportError as exc:
        raise ImportError(
            "fullbatch.lightning needs Lightning (the `lightning` or `pytorch_lightning` "
            'package); install it with: pip install "fullbatch[lightning]"'
        ) from exc

from fullbatch._base._normalize import check_count
from fullbatch._base._schedule import KeptSchedule
from fullbatch._base._sync import all_reduce_over
from fullbatch._base._verdict import CountedSteps, Verdict, WindowCounters, WindowTotals
from fullbatch._wings._close import Wing, close_window, read_totals, skip_framework_step

__all__ = ["ExactAccumulation"]

_RETURN_HINT = (
    'return {"loss": loss_sum, "count": n} from training_step, e.g. '
    "`loss_sum, n = fb.causal_lm_loss(logits, labels)`"
)
# The frameworks between the user's trainer.fit() and the callback's hooks.
_THROUGH = ("lightning", "pytorch_lightning", "lightning_fabric", "torch")


_PACKAGES = ("lightning.pytorch", "pytorch_lightning")


def _package(trainer: Any) -> Any:
    """The Lightning package ``trainer`` comes from (``lightning.pytorch`` or
    ``pytorch_lightning``, already imported by its user), found along its class's MRO so that
    a user's Trainer subclass counts; ``pl`` when neither is found (a test double)."""
    for cls in type(trainer).__mro__:
        for name in _PACKAGES:
            if cls.__module__ == name or cls.__module__.startswith(name + "."):
                return importlib.import_module(name)
    return pl


@dataclass(frozen=True)
class _Micro:
    """What one micro-batch's ``training_step`` returned, kept until the window's step."""

    loss: torch.Tensor  # detached summed loss, float64
    count: torch.Tensor  # item count, float64, on the loss's device
    divisor: int  # the K Lightning divides this micro-batch's loss by
    scale: float  # c, which the callback multiplied this micro-batch's loss by


class ExactAccumulation(CountedSteps, pl.Callback):
    """Make ``Trainer(accumulate_grad_batches=K)`` step exactly like the full batch.

    ``training_step`` must return ``{"loss": loss_sum, "count": n}``: the loss *summed* over
    the micro-batch's items and how many items that sum holds (``fb.causal_lm_loss`` and
    ``fb.cross_entropy_sum`` return both). The callback hands Lightning ``c · loss_sum``, ``c``
    a power of two ``<= 1 / N`` of the previous window (1 in the first), identical on every
    rank, which keeps fp16 gradients in range as ``fb.Accumulator`` does; Lightning
    backpropagates it divided by ``K`` as usual (DDP then averages over its ``W`` ranks). At
    ``on_before_optimizer_step`` the callback all-reduces the window's loss sum and count over
    the DDP group (one small collective, no gradient traffic) and multiplies every gradient by
    ``K * W / (c * N)``, so the optimizer, the gradient clipping (``gradient_clip_val``) and
    the GradScaler see ``∇(Σ loss_sum) / N``. The epoch's last, shorter window is normalized
    by its own count.

    How it sees the counts: at ``setup("fit")`` it sets an instance attribute
    ``training_step`` on the LightningModule that calls the original one and records its
    output (the class is untouched; ``teardown`` removes the attribute). The output's other
    keys pass through unchanged; its ``"loss"`` becomes ``c · loss_sum`` (a copy of the dict;
    the returned dict itself from the first window on, where ``c = 1``).

    Args:
        log_name: the window's true loss ``Σ loss_sum / N`` (over micro-batches and ranks) is
            logged under this name with ``pl_module.log(..., on_step=True)`` at each step;
            ``None`` logs nothing. ``self.loss`` and ``self.count`` hold the last window's.
        grad_divisor: what DDP divides the summed gradient by. ``None``: the DDP process
            group's size (DDP's own averaging). Give it when a DDP communication hook
            (``DDPStrategy(ddp_comm_hook=...)``) sums or divides differently.

    Raises (during ``fit``):
        ValueError: ``training_step`` returned a tensor or a dict without ``"count"``; a
            count that is negative or not finite; manual optimization; an
            ``accumulate_grad_batches`` that is not a positive int; a strategy other than
            single-device or DDP; a DDP communication hook without ``grad_divisor``; two
            ExactAccumulation callbacks on one Trainer.
        RuntimeError: ``accumulate_grad_batches`` changed inside a window.

    Skips a window as ``fb.Accumulator`` does (``fullbatch._base._verdict``): when it counts
    zero items, or its loss or gradient is not finite, parameters and optimizer state stay
    unchanged (every gradient set to ``None``; with a GradScaler, the scaler still backs off),
    the step-interval LR schedulers Lightning steps after it are restored (learning rates
    included), and a ``RuntimeWarning`` says so at the 1st, 2nd, 4th, ... skip.
    Epoch-interval schedulers are Lightning's. ``steps`` counts optimizer steps,
    ``skipped_windows`` the skips, ``windows`` both (as ``trainer.global_step`` does).

    Example:
        >>> from fullbatch.lightning import ExactAccumulation
        >>> cb = ExactAccumulation()
        >>> cb.steps, cb.skipped_windows, cb.windows
        (0, 0, 0)
    """

    #: What this route is called, for ``fb.probe`` (a declaration: see
    #: ``fullbatch._probe._engines``).
    fullbatch_route = "fullbatch.lightning.ExactAccumulation"

    def __init__(self, *, log_name: str | None = "train_loss", grad_divisor: float | None = None):
        if grad_divisor is not None and not (math.isfinite(grad_divisor) and grad_divisor > 0):
            raise ValueError(f"grad_divisor must be a finite number > 0, got {grad_divisor!r}")
        self.log_name = log_name
        self.grad_divisor = grad_divisor
        self.loss = math.nan  # the last window's Σ loss_sum / N
        self.count = math.nan  # the last window's N (over ranks)
        self.counters = WindowCounters()  # optimizer steps taken, windows skipped
        self._scale = 1.0  # c: a power of two <= 1 / N of the previous window, on every rank
        self._pending: list[_Micro] = []
        # a skipped window's scheduler states and param-group values, restored after
        # Lightning's scheduler step (on_train_batch_end)
        self._kept: KeptSchedule | None = None
        self._recorded = False  # this batch's training_step output was recorded
        self._module: pl.LightningModule | None = None
        # the Trainer's package's DDPStrategy, set at setup (either package's Trainer works)
        self._ddp: type = type(None)

    @property
    def windows(self) -> int:
        """Windows that reached the optimizer hook, stepped or skipped (``trainer.global_step``
        counts the same)."""
        return self.counters.windows

    # -- set-up and tear-down ------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not pl_module.automatic_optimization:
            raise ValueError(
                "ExactAccumulation works with automatic optimization only; this module sets "
                "automatic_optimization=False, so you call backward and step yourself: "
                "backpropagate summed losses and divide the gradients once by the window's "
                "total count before optimizer.step() (or train with fb.Accumulator in a "
                "plain loop), and remove the callback."
            )
        k = trainer.accumulate_grad_batches
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(
                f"Trainer(accumulate_grad_batches={k!r}): ExactAccumulation needs a positive int. "
                "For a schedule over epochs use Lightning's GradientAccumulationScheduler "
                "callback (each epoch's K is read at every micro-batch)."
            )
        package = _package(trainer)
        strategies = importlib.import_module(f"{package.__name__}.strategies")
        self._ddp = strategies.DDPStrategy
        strategy = trainer.strategy
        if strategy.handles_gradient_accumulation or not isinstance(
            strategy, (strategies.SingleDeviceStrategy, self._ddp)
        ):
            raise ValueError(
                f"ExactAccumulation supports the single-device and DDP strategies, not "
                f"{type(strategy).__name__} (from {type(strategy).__module__}): its gradient "
                f'division is not known here. Use strategy="ddp" (or "auto" on one device) in '
                f"{package.__name__}.Trainer, or fullbatch.Accumulator directly."
            )
        hook = getattr(strategy, "_ddp_comm_hook", None)
        if isinstance(strategy, self._ddp) and hook is not None and self.grad_divisor is None:
            raise ValueError(
                f"DDPStrategy(ddp_comm_hook={getattr(hook, '__name__', hook)!r}) may not average "
                "gradients over ranks the way DDP does. Pass ExactAccumulation(grad_divisor=D), "
                "D being what the hook divides the summed gradient by (the world size for "
                "averaging hooks, 1 for summing ones)."
            )
        mine = [c for c in trainer.callbacks if isinstance(c, ExactAccumulation)]  # type: ignore[attr-defined]
        if len(mine) > 1:
            raise ValueError(
                f"{len(mine)} ExactAccumulation callbacks on one Trainer would each rescale the "
                "gradient; pass one."
            )
        before = trainer.callbacks[: trainer.callbacks.index(self)]  # type: ignore[attr-defined]
        defaults = {pl.Callback.on_before_optimizer_step, package.Callback.on_before_optimizer_step}
        readers = [
            type(c).__name__ for c in before if type(c).on_before_optimizer_step not in defaults
        ]
        if readers:
            warnings.warn(
                f"callbacks {readers} come before ExactAccumulation and read the gradient in "
                "on_before_optimizer_step before it is normalized; list ExactAccumulation first "
                "in Trainer(callbacks=[...]).",
                UserWarning,
                stacklevel=2,
            )
        self._pending.clear()
        original = pl_module.training_step

        @functools.wraps(original)
        def training_step(*args: Any, **kwargs: Any) -> Any:
            return self._record(trainer, original(*args, **kwargs))

        pl_module.training_step = training_step  # type: ignore[method-assign]
        self._module = pl_module

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._module is pl_module and "training_step" in vars(pl_module):
            del pl_module.training_step  # the class's method shows through again
        self._module = None
        self._pending.clear()

    # -- one micro-batch -----------------------------------------------------------------

    def _record(self, trainer: pl.Trainer, out: Any) -> Any:
        """Check a ``training_step`` output and keep its loss sum and count for the step."""
        if out is None:  # Lightning skips this micro-batch's backward: nothing to count
            return out
        if isinstance(out, torch.Tensor):
            raise ValueError(
                f"training_step returned a tensor (shape {tuple(out.shape)}) with "
                "ExactAccumulation on: a per-micro-batch mean cannot be accumulated exactly. "
                + _RETURN_HINT
            )
        if not isinstance(out, Mapping) or "count" not in out or "loss" not in out:
            keys = sorted(map(str, out)) if isinstance(out, Mapping) else type(out).__name__
            raise ValueError(
                f"training_step returned {keys}; ExactAccumulation needs both keys: {_RETURN_HINT}"
            )
        loss, count = out["loss"], out["count"]
        if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
            raise ValueError(
                f'training_step\'s "loss" must be a 0-dim tensor (the summed loss), got '
                f"{type(loss).__name__} {tuple(getattr(loss, 'shape', ()))}"
            )
        if isinstance(count, torch.Tensor):
            # Values are checked at the window's step on every rank: raising here on one
            # rank would leave the others waiting in the count all-reduce.
            if count.numel() != 1:
                raise ValueError(
                    f'"count" must be one number, got a tensor of shape {tuple(count.shape)}'
                )
        else:
            try:
                check_count(count)  # plain numbers: now, no collective involved
            except ValueError as exc:
                raise ValueError(f'training_step\'s "count": {exc}') from None
        n = torch.as_tensor(count, dtype=torch.float64, device=loss.device).detach().reshape(())
        divisor = trainer.accumulate_grad_batches  # what Lightning divides this loss by, next
        c = self._scale
        self._pending.append(_Micro(loss.detach().to(torch.float64), n, divisor, c))
        self._recorded = True
        # Lightning backpropagates what "loss" holds: c · loss_sum (c = 1: the output as is).
        return out if c == 1.0 else {**out, "loss": loss * c}

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._drop_pending("at the start of an epoch")

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._recorded = False

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any
    ) -> None:
        # Undo the scheduler step Lightning took after a skipped window.
        if self._kept is not None:
            self._kept.restore()
            self._kept = None

    def on_before_zero_grad(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        # Lightning zeroes gradients right after the training_step of a window's first
        # micro-batch; anything recorded before it belongs to gradients that are now gone.
        newest = self._pending[-1:] if self._recorded else []
        self._pending = self._pending[: len(self._pending) - len(newest)]
        self._drop_pending("when Lightning zeroed the gradients")
        self._pending = newest

    def _drop_pending(self, when: str) -> None:
        if self._pending:
            warnings.warn(
                f"ExactAccumulation: {len(self._pending)} micro-batch(es) were accumulated but "
                f"never stepped (Lightning dropped them {when}, e.g. on_train_batch_start "
                "returned -1); their gradients are not in any step.",
                RuntimeWarning,
                stacklevel=2,
            )
            self._pending = []

    # -- the step ------------------------------------------------------------------------

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        window, self._pending = self._pending, []
        if not window:  # every training_step returned None: nothing was backpropagated
            return
        divisors = {m.divisor for m in window}
        if len(divisors) != 1:
            raise RuntimeError(
                f"accumulate_grad_batches changed inside a window ({sorted(divisors)}); change it "
                "only between epochs (GradientAccumulationScheduler does)."
            )
        counts = torch.stack([m.count for m in window])
        local = torch.stack(
            [
                torch.stack([m.loss for m in window]).sum(),
                counts.sum(),
                (~torch.isfinite(counts) | (counts < 0)).sum().to(torch.float64),
            ]
        )
        world = 1.0
        strategy = trainer.strategy
        if isinstance(strategy, self._ddp) and trainer.world_size > 1:
            group = getattr(strategy.model, "process_group", None)
            # Σ loss, Σ count, bad counts over ranks
            world = float(all_reduce_over(local, group))
        if self.grad_divisor is not None:
            world = float(self.grad_divisor)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        # DDP synced the gradients (and Lightning unscaled them): the norm is every rank's.
        grads = [p.grad for p in params if p.grad is not None]
        total_loss, total_count, bad, sq_total = read_totals(local, grads)  # one host sync
        if bad:
            raise ValueError(
                f"{int(bad)} micro-batch count(s) in this window were negative or not finite "
                f"(this rank's counts: {counts.tolist()}). " + _RETURN_HINT
            )

        def skip(verdict: Verdict) -> None:
            # Lightning steps step-interval schedulers after this window regardless: keep
            # their state and the learning rates they set, restored at on_train_batch_end.
            self._kept = skip_framework_step(
                params,
                (c.scheduler for c in trainer.lr_scheduler_configs if c.interval == "step"),
                optimizer.param_groups,
            )

        # Lightning backpropagated c · loss_sum / K; DDP averaged over `world` ranks.
        totals = WindowTotals(
            loss=total_loss,
            count=total_count,
            squared_norm=sq_total,
            divisor=divisors.pop() * world,
            loss_scale=window[0].scale,
        )
        scaler = getattr(trainer.precision_plugin, "scaler", None) is not None
        wing = Wing(self.counters, "the callback's skipped_windows", _THROUGH, scaler=scaler)
        verdict = close_window(totals, wing, grads, skip)
        self.loss, self.count = verdict.loss, total_count
        if verdict.next_loss_scale is not None:
            self._scale = verdict.next_loss_scale
        if verdict.skipped:
            return
        if self.log_name is not None:
            # a Python float would be logged as float32
            value = torch.tensor(self.loss, dtype=torch.float64)
            pl_module.log(self.log_name, value, on_step=True, on_epoch=False, batch_size=1)

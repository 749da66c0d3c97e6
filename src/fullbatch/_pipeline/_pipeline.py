"""Pipeline parallelism (``torch.distributed.pipelining``) with exact optimizer steps.

A pipeline schedule runs a loss per pipeline micro-batch on the last stage and, with
``scale_grads=True`` (torch's default), divides every ``.grad`` — earlier schedule steps'
too — by ``n_microbatches`` at the end of each ``schedule.step``; a mean loss per micro-batch
is then a mean of means. fullbatch instead:

- counts the window's items from the targets **before** any loss (on the last stage, summed
  over every rank of the job, so over the data-parallel ranks),
- hands the schedule a summed loss (:class:`PipelineLoss`) multiplied by ``c``, the largest
  power of two ``<= 1 / N`` of that count (exact in every format, the same on every rank),
- refuses ``scale_grads=True`` and a loss that is not a :class:`PipelineLoss`,
- sums gradients over the data-parallel ranks once per window (no DDP/FSDP wrapper needed on
  the stages), agrees on the norm over all stages, and ends the window through fullbatch's one
  verdict (``fullbatch._base._verdict``): a window with no counted items, a non-finite loss or a
  non-finite gradient is skipped on every stage and rank (with a warning), otherwise the
  gradients are multiplied once by ``1 / (c · N)`` and the clip, stepped and cleared.

A window is one optimizer step: one or several ``schedule.step`` calls (``window.run``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from fullbatch._base._normalize import power_of_two_scale, squared_norm
from fullbatch._base._stats import StepStats
from fullbatch._base._sync._pipeline import PipelineComm
from fullbatch._base._verdict import CountedSteps, WindowCounters, WindowTotals
from fullbatch._base._versions import check_pipeline_schedule
from fullbatch._pipeline._scale import check_scaler, finish_scaler, window_scale
from fullbatch._wings._close import Wing, close_window

__all__ = ["Pipeline", "PipelineLoss", "PipelineWindow"]


class PipelineLoss:
    """The schedule's ``loss_fn``: ``fn(output, target)`` summed, times the window's ``c``.

    ``fn`` returns a summed loss, or ``(loss_sum, count)`` like :func:`cross_entropy_sum`
    (the count is ignored: the window's count is known before the loss). Outside
    :meth:`PipelineWindow.run` it raises, so a schedule cannot silently run unnormalized.

    Example:
        >>> import torch, fullbatch as fb
        >>> loss = fb.PipelineLoss(fb.cross_entropy_sum)
        >>> loss.loss_scale = 0.25  # c, set by PipelineWindow.run (here N = 4)
        >>> round(float(loss(torch.zeros(2, 3), torch.tensor([0, -100]))), 4)
        0.2747
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.loss_scale: float | None = None  # c, set by PipelineWindow.run
        self.scale = 1.0  # a GradScaler's scale, set by PipelineWindow.run

    def __call__(self, output: torch.Tensor, target: torch.Tensor, **kwargs: Any) -> Any:
        if self.loss_scale is None:
            raise RuntimeError(
                "a fullbatch.PipelineLoss ran outside a window: call schedule.step through "
                "window = pipeline.window(targets); window.run(...), which sets the "
                "window's count first."
            )
        out = self.fn(output, target, **kwargs)
        loss_sum = out[0] if isinstance(out, tuple) else out
        return loss_sum * (self.loss_scale * self.scale)  # powers of two: exact


def _labels(target: torch.Tensor) -> torch.Tensor:
    return (target != -100).sum()


def _stages(schedule: Any) -> list[Any]:
    stages = getattr(schedule, "_stages", None)  # multi-stage schedules (interleaved)
    return list(stages) if stages is not None else [schedule._stage]


class Pipeline(CountedSteps):
    """Exact optimizer steps over a ``torch.distributed.pipelining`` schedule.

    Args:
        schedule: a schedule built with ``loss_fn=fb.PipelineLoss(<summed loss>)`` and
            ``scale_grads=False`` (GPipe, 1F1B, interleaved 1F1B, ...).
        optimizer: the optimizer over this rank's stage parameters.
        count: items of one target (the last stage's labels); default: labels != -100.
        dp_group: ranks holding the same stages with other data; their gradients are summed
            once per window. ``None``: a single pipeline.
        group: every rank of the job (all stages, all data-parallel ranks); default: world.
        max_grad_norm: clip the total norm over all stages.
        scheduler: an LR scheduler stepped after each optimizer step that was not skipped.
        scaler: a ``torch.amp.GradScaler`` (the same settings on every rank): its scale
            multiplies each pipeline micro-batch's loss; ``step()`` unscales after the DP sum,
            before the norm and the clip, skips on every stage and rank if any gradient is
            non-finite, and updates the scaler once per window, identically everywhere.

    Raises:
        RuntimeError: torch older than 2.7 (its schedules have no ``scale_grads``).
        ValueError: ``scale_grads=True`` or a loss that is not a :class:`PipelineLoss`
            (before anything runs), naming the fix.

    Example (on every rank; ``schedule`` built as above)::

        pipe = fb.Pipeline(schedule, optimizer, dp_group=dp)
        window = pipe.window(targets if last_stage else None)  # the count, before any loss
        for x, y in batches:                                   # one or several schedule steps
            window.run(x if first_stage else None, target=y if last_stage else None)
        stats = window.step()                                  # identical on every rank
    """

    def __init__(
        self,
        schedule: Any,
        optimizer: torch.optim.Optimizer,
        *,
        count: Callable[[torch.Tensor], Any] | None = None,
        dp_group: Any = None,
        group: Any = None,
        max_grad_norm: float | None = None,
        scheduler: Any = None,
        scaler: Any = None,
    ) -> None:
        check_pipeline_schedule(schedule)
        if schedule.scale_grads:
            raise ValueError(
                f"{type(schedule).__name__} has scale_grads=True: it divides every .grad, "
                "earlier schedule steps' too, by n_microbatches after each schedule.step. "
                "Build it with scale_grads=False and loss_fn=fb.PipelineLoss(<summed loss>): "
                "fullbatch normalizes once, by the window's count."
            )
        loss = getattr(schedule, "_loss_fn", None)
        if not isinstance(loss, PipelineLoss):
            raise ValueError(
                f"the schedule's loss_fn is {loss!r}, not a fullbatch.PipelineLoss: a mean loss "
                "per pipeline micro-batch is a mean of means. Build the schedule with "
                "loss_fn=fb.PipelineLoss(fb.cross_entropy_sum) (any summed loss) and "
                "scale_grads=False."
            )
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0, got {max_grad_norm!r}.")
        self.schedule = schedule
        self.optimizer = optimizer
        self.loss = loss
        self._count = count or _labels
        self._comm = PipelineComm(group, dp_group)
        self._last = any(getattr(s, "is_last", False) for s in _stages(schedule))
        self._max_grad_norm = max_grad_norm
        self._scheduler = scheduler
        self.scaler = check_scaler(scaler)
        self.counters = WindowCounters()  # optimizer steps taken, windows skipped

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"] if p.requires_grad]

    def window(self, targets: Sequence[torch.Tensor] | None) -> PipelineWindow:
        """Open a window: count its items (last stage: ``targets`` of every schedule step).

        Every rank of the job calls it (one tiny all-reduce); other stages pass ``None``.
        """
        if any(p.grad is not None for p in self._params()):
            raise RuntimeError(
                "gradients are already present when a pipeline window opens; fullbatch "
                "accumulates from zero. Call optimizer.zero_grad(set_to_none=True) first."
            )
        local = 0.0
        if self._last and targets is not None:
            local = float(sum(float(self._count(t)) for t in targets))
        (count,) = self._comm.sum([local])
        scale = 1.0
        if self.scaler is not None:
            params = self._params()
            scale = window_scale(self.scaler, params[0].device if params else torch.device("cpu"))
        return PipelineWindow(self, count, scale)


class PipelineWindow:
    """One optimizer step: ``run`` one or several schedule steps, then ``step()``."""

    def __init__(self, pipeline: Pipeline, count: float, scale: float = 1.0) -> None:
        self._pipe = pipeline
        self.count = count
        self.loss_scale = power_of_two_scale(count)  # c <= 1 / N: N is known before any loss
        self.scale = scale  # the GradScaler's scale for the whole window (1: none)
        self.micro_batches = 0
        # The summed losses of real micro-batches. Not summed in the loss function: torch's
        # metadata inference calls it once more on a first step.
        self._losses: list[torch.Tensor] = []

    def run(
        self, *args: Any, target: Any = None, losses: list[Any] | None = None, **kwargs: Any
    ) -> Any:
        """``schedule.step(*args, target=target, losses=losses, **kwargs)``, the loss
        multiplied by the window's ``c``; ``losses`` (last stage) receives each pipeline
        micro-batch's ``loss_sum / N`` (unscaled, with a GradScaler too)."""
        pipe = self._pipe
        losses = [] if losses is None else losses
        pipe.loss.loss_scale, pipe.loss.scale = self.loss_scale, self.scale
        try:
            out = pipe.schedule.step(*args, target=target, losses=losses, **kwargs)
        finally:
            pipe.loss.loss_scale, pipe.loss.scale = None, 1.0
        sums = [t.detach() / (self.loss_scale * self.scale) for t in losses]  # exact: 2^k
        self._losses.extend(sums)
        losses[:] = [t / self.count for t in sums] if self.count > 0 else sums
        self.micro_batches += int(getattr(pipe.schedule, "_n_microbatches", 1))
        return out

    def step(self) -> StepStats:
        """Sum gradients over DP ranks, unscale (a GradScaler), agree on the norm, clip, step,
        update the scaler, clear. Collective."""
        pipe = self._pipe
        params = pipe._params()
        for p in params:
            if p.grad is None:  # no backward reached it here: sum zeros (matched collectives)
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params if p.grad is not None]
        pipe._comm.sum_grads(grads)
        if pipe.scaler is not None:
            pipe.scaler.unscale_(pipe.optimizer)  # after the DP sum: an inf reaches every rank
        # After the DP sum, DP ranks hold equal gradients: each adds its share of the norm.
        sq = float(squared_norm(grads, torch.device("cpu"))) / pipe._comm.dp_world
        mine = float(sum(float(t) for t in self._losses)) if pipe._last else 0.0
        loss, sq = pipe._comm.sum([mine, sq])  # the window's Σ loss_sum, the squared norm
        totals = WindowTotals(
            loss=loss,
            count=self.count,
            squared_norm=sq,
            loss_scale=self.loss_scale,
            max_grad_norm=pipe._max_grad_norm,
        )
        wing = Wing(
            pipe.counters,
            "pipe.skipped_windows and stats.skipped_windows",
            scaler=pipe.scaler is not None,
            clips=True,  # max_grad_norm is the pipeline's own
        )
        verdict = close_window(totals, wing, grads)  # scaled by W / (c·N) and the clip
        if not verdict.skipped:
            if pipe.scaler is not None:
                pipe.scaler.step(pipe.optimizer)  # every gradient here is finite: it steps
            else:
                pipe.optimizer.step()
            if pipe._scheduler is not None:
                pipe._scheduler.step()
        if pipe.scaler is not None:  # the job-wide verdict, not this stage's own
            finish_scaler(pipe.scaler, self.scale, not totals.grad_finite)
        pipe.optimizer.zero_grad(set_to_none=True)
        groups = pipe.optimizer.param_groups
        return StepStats(
            loss=verdict.loss,
            count=self.count,
            grad_norm=verdict.grad_norm,
            skipped=verdict.skipped,
            reason=verdict.reason,
            steps=pipe.counters.steps,
            loss_scale=self.loss_scale,
            lr=float(groups[0]["lr"]) if groups and "lr" in groups[0] else None,
            micro_batches=self.micro_batches,
            skipped_windows=pipe.counters.skipped_windows,
        )


# Public at the root: reprs and pickles name fullbatch.Pipeline, whichever file defines it.
Pipeline.__module__ = "fullbatch"
PipelineLoss.__module__ = "fullbatch"
# doctest skips classes whose __module__ is elsewhere: name the example here.
__test__ = {"PipelineLoss": PipelineLoss}

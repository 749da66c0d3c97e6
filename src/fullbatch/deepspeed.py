"""Exact gradient accumulation on a raw DeepSpeed engine (``deepspeed.initialize``).

A DeepSpeed engine divides every loss by ``gradient_accumulation_steps`` in
``engine.backward`` and averages gradients over its data-parallel ranks ``W``; a per-micro-batch
*mean* loss then weights micro-batches equally, whatever they hold (a mean of means: 41% off
the full batch on uneven micro-batches with ``-100`` labels, measured by
``benchmarks/deepspeed_accumulation.py``). At ZeRO stages 2 and 3 the engine reduces and
partitions each gradient during backward (and, with offload, copies it to the CPU), so nothing
can rescale the accumulated gradient afterwards. :class:`ExactEngine` therefore fixes the scale
**before** the window's first backward:

- it reads the window (``gradient_accumulation_steps`` micro-batches per rank), counts each
  micro-batch's items with your ``count`` function and sums them over the data-parallel ranks
  (one small all-reduce, which also tells every rank how many micro-batches the others hold);
- each ``window.backward(loss_sum, n)`` is ``engine.backward(loss_sum · W / N,
  scale_wrt_gas=False)``: the engine's own ``1 / GA`` is switched off and its average over
  ``W`` ranks undone, so the gradient DeepSpeed applies is ``∇(Σ loss_sum) / N`` over every
  micro-batch and rank, at every ZeRO stage, with or without CPU offload. DeepSpeed's own
  ``gradient_clipping`` then clips the full-batch gradient;
- the boundary is set on every micro-batch (``set_gradient_accumulation_boundary``), so a short
  last window steps on its own count; a rank with fewer micro-batches runs padding
  micro-batches (a copy of its last one, ``window.is_padding``, zero weight), because ZeRO 2/3
  reduce during every backward and every rank must run as many;
- ``n`` must equal what ``count`` said for that micro-batch (checked before the window's last
  backward: DeepSpeed steps at the boundary), so the scale and the loss never disagree;
- a window is closed through fullbatch's one verdict (:mod:`fullbatch._wings._close`): zero
  items skips it before anything runs; a non-finite loss (on any rank) turns that micro-batch's
  scale into NaN so that DeepSpeed's own overflow check skips the step (ZeRO 1-3: parameters,
  optimizer state and LR schedule untouched); stage 0 keeps gradients in ``.grad``, where the
  window checks and clears them itself.

Refused, with the reason: MoE layers and sequence parallelism (their gradients are divided by
other groups), fp16/bf16 at stage 0 (DeepSpeed's own mixed-precision optimizer owns the
gradients there), ZeRO-2 ``offload_optimizer`` with more than one backward per step on
deepspeed < 0.19.0 (it kept only one backward's gradient: DeepSpeed #6550's regression, fixed
by #7967 and #7981; ZeRO-1 and ZeRO-3 offload were exact on 0.17.0).

Example (one process; the same code runs under ``deepspeed``/``torchrun``)::

    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    exact = fullbatch.deepspeed.ExactEngine(engine, count=lambda m: fb.count_tokens(m["labels"]))
    for window in exact.windows(loader):          # loader yields micro-batches
        for micro in window:
            logits = engine(micro["input_ids"]).logits
            loss_sum, n = fb.causal_lm_loss(logits, micro["labels"])
            window.backward(loss_sum, n)
        stats = window.step()                      # StepStats, identical on every rank
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from fullbatch._base._normalize import check_count
from fullbatch._base._stats import StepStats
from fullbatch._base._sync import sum_over_ranks
from fullbatch._base._verdict import NO_ITEMS, CountedSteps, WindowCounters
from fullbatch._wings._close import Wing
from fullbatch._wings._deepspeed import (
    OFFLOAD_FIXED,
    check_engine,
    close_engine_window,
    refusal,
    scaled,
)

__all__ = ["OFFLOAD_FIXED", "DeepSpeedWindow", "ExactEngine", "check_engine", "refusal"]


class ExactEngine(CountedSteps):
    """Windows of micro-batches on a DeepSpeed engine, each step the full-batch step.

    Args:
        engine: what ``deepspeed.initialize`` returned first, with an optimizer.
        count: ``fn(micro) -> number``: the items the micro-batch's summed loss holds (e.g.
            ``lambda m: fb.count_tokens(m["labels"])`` for a causal LM), computed before the
            forward; ``window.backward`` checks the loss's count against it.
        micro_batches: micro-batches per rank in a window; default the engine's
            ``gradient_accumulation_steps``.

    Raises:
        ValueError: what :func:`check_engine` refuses; a ``micro_batches`` that is not a
            positive int.

    ``steps`` counts optimizer steps; ``skipped_windows`` the skipped windows (each warns).
    """

    #: What this route is called, for ``fb.probe`` (a declaration: see
    #: ``fullbatch._probe._engines``).
    fullbatch_route = "fullbatch.deepspeed.ExactEngine"

    def __init__(
        self, engine: Any, *, count: Callable[[Any], Any], micro_batches: int | None = None
    ) -> None:
        k = engine.gradient_accumulation_steps() if micro_batches is None else micro_batches
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"micro_batches must be a positive int, got {k!r}.")
        check_engine(engine, k)
        self.engine = engine
        self.count = count
        self.micro_batches = k
        self.world = int(engine.dp_world_size)  # DeepSpeed averages gradients over them
        self.counters = WindowCounters()
        self._wing = Wing(self.counters, "exact.skipped_windows and stats.skipped_windows")

    def windows(self, loader: Iterable[Any]) -> Iterator[DeepSpeedWindow]:
        """Cut ``loader`` (micro-batches) into windows; the last may be shorter. Collective:
        every rank iterates, until every rank's loader is exhausted."""
        it = iter(loader)
        while True:
            micros = []
            for _ in range(self.micro_batches):
                try:
                    micros.append(next(it))
                except StopIteration:
                    break
            window = DeepSpeedWindow(self, micros)
            if window.size == 0:  # every rank is out of data
                return
            yield window
            if window._ran and not window._stepped:
                raise RuntimeError(
                    "a DeepSpeed window ended without window.step(); call it after the "
                    "window's last backward (DeepSpeed stepped at the boundary anyway)."
                )


class DeepSpeedWindow:
    """One optimizer step: iterate its micro-batches, ``backward`` each, then ``step()``."""

    fullbatch_route = ExactEngine.fullbatch_route  # its step() is the frame above engine.step()

    def __init__(self, exact: ExactEngine, micros: list[Any]) -> None:
        self._exact = exact
        self._micros = micros
        engine = exact.engine
        counts = [check_count(exact.count(m)) for m in micros]
        self._counts = [float(c) for c in counts]
        k = exact.micro_batches
        # [Σ count, how many ranks hold 0, 1, ..., K micro-batches]: one collective says both
        # the window's N and the largest number of micro-batches (what every rank runs).
        local = torch.zeros(k + 2, dtype=torch.float64, device=engine.device)
        local[0] = sum(self._counts)
        local[1 + len(micros)] = 1.0
        sum_over_ranks(local)
        held = local[1:].tolist()
        self.count = float(local[0])
        self.size = max(i for i, n in enumerate(held) if n > 0 or i == 0)
        if self.size and held[0] > 0:
            raise ValueError(
                f"{int(held[0])} rank(s) have no micro-batch left while others have up to "
                f"{self.size}: ZeRO reduces in every backward, so every rank must run the "
                "window. Give every rank the same number of micro-batches (e.g. a "
                "DistributedSampler with drop_last=True, or pad the dataset)."
            )
        self.scale = exact.world / self.count if self.count > 0 else 0.0
        self.is_padding = False
        self._index = -1
        self._done = 0  # backward calls
        self._losses: list[torch.Tensor] = []
        self._mismatch = torch.zeros((), dtype=torch.float64, device=engine.device)
        self._ran = False
        self._stepped = False

    def __len__(self) -> int:
        return self.size if self.count > 0 else 0

    def __iter__(self) -> Iterator[Any]:
        if self.count == 0:
            return  # nothing runs: step() skips the window (no items)
        engine = self._exact.engine
        self._ran = True
        for i in range(self.size):
            self._index = i
            self.is_padding = i >= len(self._micros)
            engine.set_gradient_accumulation_boundary(i == self.size - 1)
            yield self._micros[min(i, len(self._micros) - 1)]
        self._index = self.size

    def backward(self, loss_sum: torch.Tensor, count: Any, **kwargs: Any) -> None:
        """``engine.backward(loss_sum · W / N, scale_wrt_gas=False)`` for the last yielded
        micro-batch; ``count`` must be what ``count(micro)`` gave for it."""
        i = self._index
        if not 0 <= i < self.size or self._done > i:
            raise RuntimeError(
                "window.backward belongs to the micro-batch just yielded: one call per "
                "micro-batch, inside `for micro in window`."
            )
        self._done = i + 1
        engine = self._exact.engine
        if self.is_padding:
            loss = loss_sum * 0.0  # runs every collective of the backward, weighs nothing
        else:
            n = check_count(count)
            n = torch.as_tensor(n, dtype=torch.float64, device=self._mismatch.device)
            self._mismatch += (n - self._counts[i]).abs()
            self._losses.append(loss_sum.detach().double().reshape(1))
            # a non-finite loss poisons the gradient, so DeepSpeed's overflow check skips
            loss = scaled(loss_sum, self.scale)
        if i == self.size - 1:
            self._check_counts()
        engine.backward(loss, scale_wrt_gas=False, **kwargs)

    def _check_counts(self) -> None:
        bad = float(self._mismatch)  # the one host sync before DeepSpeed steps
        if bad:
            raise ValueError(
                f"window.backward got counts that differ from count(micro) by {bad:g} items "
                f"in total (count(micro) gave {self._counts}); the loss would be scaled by "
                "another N than it holds. Make count() count exactly the items the summed "
                "loss holds (e.g. the causal shift: fb.count_tokens(labels, shift=True))."
            )

    def step(self) -> StepStats:
        """Let DeepSpeed step (or skip) and close the window through the verdict."""
        exact, engine = self._exact, self._exact.engine
        if self._stepped:
            raise RuntimeError("window.step() was already called for this window.")
        if self.count > 0 and self._done < self.size:
            raise RuntimeError(
                f"window.step() after {self._done} of {self.size} backward calls: every "
                "micro-batch of the window (padding ones too) needs its backward first."
            )
        self._stepped = True
        local = torch.cat(self._losses).sum().reshape(1) if self._losses else None
        if local is None:
            local = torch.zeros(1, dtype=torch.float64, device=engine.device)
        verdict, _ = close_engine_window(
            engine,
            exact._wing,
            local,
            sum_over_ranks,
            count=self.count,
            loss_divisor=self.count,
            ran=self.count > 0,
        )
        groups = getattr(engine.optimizer, "param_groups", None) or [{}]
        lr = groups[0].get("lr")
        return StepStats(
            loss=verdict.loss,
            count=self.count,
            grad_norm=verdict.grad_norm if verdict.reason != NO_ITEMS else math.nan,
            skipped=verdict.skipped,
            reason=verdict.reason,
            steps=exact.counters.steps,
            loss_scale=self.scale,
            lr=None if lr is None else float(lr),
            micro_batches=self._done,
            skipped_windows=exact.counters.skipped_windows,
        )

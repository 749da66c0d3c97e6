"""Exact gradient accumulation on a raw DeepSpeed engine (``deepspeed.initialize``).

DeepSpeed divides each loss by ``gradient_accumulation_steps`` and, at ZeRO 2/3, reduces and
partitions each gradient during backward, so nothing can rescale the window afterwards.
:class:`ExactEngine` counts the window before its first backward (one all-reduce, which also
says how many micro-batches each rank holds: a short rank runs zero-weight padding
micro-batches) and backpropagates ``loss_sum · W / N`` with ``scale_wrt_gas=False``; the
window closes through the shared verdict (:mod:`fullbatch._wings._deepspeed`). What is
refused, and why: :func:`refusal`. The whole story, measured: docs/distributed.md
("DeepSpeed").

Example (one process; the same code runs under ``deepspeed``/``torchrun``)::

    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    exact = fullbatch.deepspeed.ExactEngine(engine, count=lambda m: fb.count_tokens(m["labels"]))
    for window in exact.windows(loader):          # loader yields micro-batches
        for micro in window:
            logits = engine(micro["input_ids"]).logits
            loss_sum, n = fb.causal_lm_loss(logits, micro["labels"])
            window.backward(loss_sum, n)
        stats = window.step()                      # StepStats, identical on every rank

A window statistic (a MoE model's routing counts for its load-balancing loss) comes from
``window.stats(fn)`` before the window's first micro-batch, as on ``fb.Accumulator``'s
windows (docs/moe.md, "DeepSpeed").
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from fullbatch._base._normalize import check_count
from fullbatch._base._prepass import check_reduce, default_key, too_late
from fullbatch._base._stats import StepStats
from fullbatch._base._sync import sum_over_ranks
from fullbatch._base._verdict import NO_ITEMS, CountedSteps, WindowCounters
from fullbatch._wings._close import Wing
from fullbatch._wings._deepspeed import (
    OFFLOAD_FIXED,
    check_engine,
    close_engine_window,
    engine_stats,
    refusal,
    scaled,
)
from fullbatch._wings._window import WingWindow, count_ahead

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
        # N and how many ranks hold 0, 1, ..., K micro-batches: one collective says both the
        # window's N and the largest number of micro-batches (what every rank runs).
        ahead = count_ahead(
            [sum(self._counts)],
            sum_over_ranks,
            engine.device,
            held=len(micros),
            most=exact.micro_batches,
        )
        self.count, self.size = ahead.sums[0], ahead.most
        # padding micro-batches over every rank: ranks holding j run size - j of them
        self._padding = int(sum(n * (self.size - j) for j, n in enumerate(ahead.held)))
        if self.size and ahead.held[0] > 0:
            raise ValueError(
                f"{int(ahead.held[0])} rank(s) have no micro-batch left while others have up to "
                f"{self.size}: ZeRO reduces in every backward, so every rank must run the "
                "window. Give every rank the same number of micro-batches (e.g. a "
                "DistributedSampler with drop_last=True, or pad the dataset)."
            )
        self.scale = exact.world / self.count if self.count > 0 else 0.0
        self.is_padding = False
        self._index = -1
        self._done = 0  # backward calls
        self._numbers = WingWindow(self.scale, device=engine.device, counted=self._counts)
        self._ran = False
        self._stepped = False
        self._stats: dict[str, Any] = {}  # window.stats results, by key
        self._stats_seconds = 0.0

    def __len__(self) -> int:
        return self.size if self.count > 0 else 0

    def fullbatch_padding(self) -> int:
        """The zero-weight padding micro-batches this window runs over every rank (the same
        number on every rank), for ``fb.probe``: it cannot tell them from micro-batches."""
        return self._padding if self.count > 0 else 0

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

    def stats(
        self, fn: Callable[[Any], Any], *, reduce: str = "sum", key: str | None = None
    ) -> Any:
        """A window statistic: ``fn`` on every micro-batch of the window and every rank, once,
        before the first micro-batch, no gradients; ``reduce="sum"`` (float64) or ``"cat"``
        (dim 0, ranks in order), kept under ``key`` (default: ``fn``'s name and line) for a
        second call. Collective: every rank calls it. As ``fb.Accumulator``'s (docs/moe.md).

        Raises:
            RuntimeError: called once the window's micro-batches began, or after its step.
            ValueError: ``reduce`` unknown; ``fn`` returned no tensors, or (``"sum"``)
                shapes that differ between micro-batches.
        """
        check_reduce(reduce)
        key = default_key(fn) if key is None else key
        if key in self._stats:
            return self._stats[key]
        if self._stepped or self._index >= 0:
            raise too_late(
                key,
                "this DeepSpeed window",
                f"{min(self._index + 1, self.size)} yielded, {self._done} backward call(s)",
                "Call `stats = window.stats(fn)` before `for micro in window:`.",
            )
        began = time.perf_counter()
        value = engine_stats(self._exact.engine, self._micros, self.size, fn, reduce)
        self._stats[key] = value
        self._stats_seconds += time.perf_counter() - began
        return value

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
            self._numbers.record(loss_sum, check_count(count))
            # a non-finite loss poisons the gradient, so DeepSpeed's overflow check skips
            loss = scaled(loss_sum, self.scale)
        if i == self.size - 1:  # the one host sync before DeepSpeed steps
            self._numbers.check_counted(
                "window.backward",
                "count(micro)",
                "Make count() count exactly the items the summed loss holds (e.g. the causal "
                "shift: fb.count_tokens(labels, shift=True)).",
            )
        engine.backward(loss, scale_wrt_gas=False, **kwargs)

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
        verdict, _ = close_engine_window(
            engine,
            exact._wing,
            self._numbers,
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
            stats_seconds=self._stats_seconds,
        )

"""torch.compile through fullbatch and through the hand-written loop it replaces, with the
dynamo counters of each run (tests/engine/test_compile.py, the DDP case in 2 gloo ranks)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import fullbatch as fb
from _sync_cases import TinyLM


class _Recompiles(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.functions: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Recompiling function"):
            self.functions.append(message.splitlines()[0])


def dynamo_counts(run: Callable[[], Any]) -> dict[str, Any]:
    """What torch.compile did while ``run()`` ran, from a fresh dynamo cache.

    ``graph_breaks``: the distinct reasons (first line); ``recompiles``: functions dynamo
    compiled again after a guard failed (its ``recompiles`` log); ``graphs``: graphs captured.
    """
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    handler = _Recompiles()
    logger = logging.getLogger("torch._dynamo.guards.__recompiles")
    torch._logging.set_logs(recompiles=True)
    logger.addHandler(handler)
    saved, logger.propagate = logger.propagate, False  # counted here, not printed
    try:
        run()
    finally:
        logger.removeHandler(handler)
        logger.propagate = saved
        torch._logging.set_logs()
    return {
        "graph_breaks": sorted({k.split("\n")[0] for k in counters["graph_break"]}),
        "recompiles": handler.functions,
        "graphs": counters["stats"]["unique_graphs"],
    }


def hand_loop(model: nn.Module, forward: Any, windows: list[list[dict[str, Any]]]) -> None:
    """Up-front count, ``loss_sum / N`` per micro-batch, clip, AdamW."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for window in windows:
        n = sum(fb.count_tokens(m["labels"]) for m in window)
        for m in window:
            loss_sum, _ = fb.causal_lm_loss(forward(m["input_ids"]), m["labels"])
            (loss_sum / n).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)


def with_fullbatch(
    model: nn.Module, forward: Any, loader: Any, seen: list[list[Any]] | None = None, **options: Any
) -> None:
    """The plain fullbatch loop; ``seen`` collects each window's micro-batches."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with fb.Accumulator(model, opt, max_grad_norm=1.0, **options) as acc:
        for window in acc.windows(loader):
            micros = []
            for m in window:
                micros.append(m)
                window.backward(*fb.causal_lm_loss(forward(m["input_ids"]), m["labels"]))
            window.step()
            if seen is not None:
                seen.append(micros)


def ddp_compiled(rank: int, world: int, k: int, windows: int) -> dict[str, dict[str, int]]:
    """``torch.compile(DDP(model))``: the hand loop with ``no_sync()`` on all but the last
    micro-batch, and fullbatch, which sets ``require_backward_grad_sync`` per micro-batch."""
    import contextlib

    from _sync_cases import lm_data

    data = lm_data(k * windows, seed=rank)
    split = [data[w * k : (w + 1) * k] for w in range(windows)]

    def hand() -> None:
        torch.manual_seed(0)
        ddp = nn.parallel.DistributedDataParallel(TinyLM())
        compiled = torch.compile(ddp, backend="aot_eager")
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        for window in split:
            n = sum(fb.count_tokens(m["labels"]) for m in window)
            for i, m in enumerate(window):
                context = ddp.no_sync() if i < len(window) - 1 else contextlib.nullcontext()
                with context:
                    loss_sum, _ = fb.causal_lm_loss(compiled(m["input_ids"]), m["labels"])
                    (loss_sum / n).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    def ours() -> None:
        torch.manual_seed(0)
        ddp = nn.parallel.DistributedDataParallel(TinyLM())
        compiled = torch.compile(ddp, backend="aot_eager")
        with_fullbatch(ddp, compiled, data, micro_batches=k)

    return {"hand": dynamo_counts(hand), "fullbatch": dynamo_counts(ours)}

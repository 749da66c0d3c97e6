"""Rank functions for ``window.run`` under DDP (see test_distributed_run)."""

from __future__ import annotations

from typing import Any

import torch

import fullbatch as fb
from _dist_cases import _full_params, make_model, make_optimizer, micro_batch, wrap


class Boom(Exception):
    pass


def run_with_error(rank: int, world: int, wrapper: str) -> dict[str, Any]:
    """Every rank raises in window 0's second micro-batch; window 1 trains normally."""
    model = wrap(make_model(), wrapper)
    opt = make_optimizer(model.parameters())
    data = [micro_batch(rank, i, 2 + i % 3) for i in range(6)]
    calls = [0]

    def fn(micro: Any) -> Any:
        calls[0] += 1
        out = fb.cross_entropy_sum(model(micro["x"]), micro["y"])
        if calls[0] == 2:
            raise Boom("in micro-batch 2")
        return out

    result: dict[str, Any] = {}
    with fb.Accumulator(model, opt, micro_batches=3) as acc:
        for window in acc.windows(data):
            if window.index == 0:
                try:
                    window.run(fn)
                except Boom:
                    result["raised"] = True
                result["grads_after_error"] = [p.grad is not None for p in model.parameters()]
                result["sync_flag"] = getattr(model, "require_backward_grad_sync", True)
                continue
            window.run(fn)
            result["params"] = _full_params(model)
    return result


def reference(world: int) -> torch.Tensor:
    from _dist_cases import reference_run

    windows = [[micro_batch(r, i, 2 + i % 3) for r in range(world) for i in range(3, 6)]]
    return reference_run(windows)[-1]

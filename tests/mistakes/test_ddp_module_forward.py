"""Issue 26: the Accumulator built on the DDP wrapper, the forward through ``ddp.module``.

DDP prepares its gradient sync in its own forward; ``ddp.module(x)`` skips it, so no gradient
is reduced and each rank steps with its own (measured on the old code with a tiny Llama on 2
ranks: 98% off the full batch, the ranks' updates 136% apart). Now every rank raises at its
first backward, before any collective of the window's backward or step, and nothing changes.
2 gloo ranks; every rank's outcome checked; DDP's all-reduces counted by a comm hook.
"""

from __future__ import annotations

import pytest
import torch

import _dist_route as cases
from _dist import run_ranks, values

pytestmark = pytest.mark.timeout(180)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_the_mistake_trains_each_rank_on_its_own_half() -> None:
    """Without a sync, rank r's gradient is its half's, times W / N: wrong, ranks diverge."""
    model = cases.make_model()
    n = int((cases.batch()["labels"][:, 1:] != -100).sum())
    want = cases.full_batch_grad(model) / n
    ranks = [cases.full_batch_grad(model, slice(4 * r, 4 * r + 4)) * 2 / n for r in range(2)]
    assert _rel(ranks[0], want) > 0.5 and _rel(ranks[1], want) > 0.5
    assert _rel(ranks[0], ranks[1]) > 0.5


def test_forward_through_the_inner_module_raises_on_every_rank_and_changes_nothing() -> None:
    results = values(run_ranks(cases.route, 2))
    model = cases.make_model()
    n = int((cases.batch()["labels"][:, 1:] != -100).sum())
    want = cases.full_batch_grad(model) / n
    for rank, out in enumerate(results):
        assert out["error"] is not None, f"rank {rank} did not raise"
        assert "model.module(...)" in out["error"] and "ddp_model(**inputs)" in out["error"]
        assert "ddp_sync='step'" in out["error"]
        assert out["unchanged"] and out["optimizer_state"] == 0 and out["grads"] == 0
        # raised before any gradient all-reduce and any collective of the window's step
        assert out["buckets_after_mistake"] == 0
        assert out["collectives_after_mistake"] == {"ag:world": 1}  # the window-start exchange
        # the correct form, on the same Accumulator: synced (DDP's buckets) and exact
        assert out["buckets"] >= 1 and out["count"] == n
        assert _rel(out["update"], want) < 1e-12
        # ddp_sync="step": fullbatch reduces at the step, so the inner forward is exact
        assert _rel(out["step_update"], want) < 1e-12
    assert torch.equal(results[0]["update"], results[1]["update"])
    assert torch.equal(results[0]["step_update"], results[1]["step_update"])

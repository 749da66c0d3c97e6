"""``fb.probe`` on a tiny Mixtral under 2 gloo DDP ranks with uneven micro-batches (2 on rank 0,
3 on rank 1): the window's routing counts are summed over the ranks, so the exact route
(``window.stats``) is right and the Trainer's recipe (the aux loss per micro-batch) is named
"a window statistic taken per micro-batch" on every rank, its error the one measured here
against the float64 full batch of every rank's rows."""

from __future__ import annotations

import pytest

import _dist_moe as cases
from _dist import run_ranks, values
from _moe_cases import make_moe, reference, rel_err
from fullbatch._probe._window_stat import NAMED

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)


def test_moe_probe_over_two_ranks() -> None:
    results = values(run_ranks(cases.probed_moe_rank, 2, pg_timeout=60, deadline=240))
    model = make_moe("mixtral")
    model.config.output_router_logits = True
    want, _ = reference(model, cases.moe_window())
    for rank in results:
        exact, stock = rank["exact"], rank["stock"]
        assert exact["ok"] and exact["objective"] == "causal_lm+moe", exact["patterns"]
        assert rel_err(exact["update"], want) < 1e-12
        truth = rel_err(stock["update"], want)
        assert not stock["ok"] and stock["patterns"] == (NAMED,), stock["patterns"]
        assert stock["share"] > 0.99 and abs(stock["error"] - truth) <= 1e-6 * truth
    assert results[0]["stock"]["share"] == results[1]["stock"]["share"]

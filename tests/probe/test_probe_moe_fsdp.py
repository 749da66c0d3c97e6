"""``fb.probe`` on a tiny float64 Mixtral with its router aux loss under FSDP2 (``fully_shard``
per decoder layer and at the root, 2 gloo ranks, 2 micro-batches of uneven rows on each): a
plain loop that adds each micro-batch's own aux loss (TRL's recipe by hand) is named "a window
statistic taken per micro-batch" on every rank, its error the one measured here against a
float64 full batch of every rank's rows; ``fb.Accumulator`` with ``window.stats`` and
``fb.moe.load_balancing`` is right. On uneven micro-batch counts (2 and 3), where the
Accumulator runs a zero-weight padding micro-batch on rank 0, the probe refuses the window on
every rank, naming why, and the run's step is still the full batch's
(tests/_probe_moe_fsdp_cases.py)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers")

import _probe_moe_fsdp_cases as cases
from _dist import run_ranks, values
from _dist_moe import moe_window
from _moe_cases import make_moe, reference, rel_err
from fullbatch._probe._window_stat import NAMED

pytestmark = [pytest.mark.timeout(300), pytest.mark.fsdp2]


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return values(run_ranks(cases.moe_fsdp, 2, pg_timeout=60, deadline=240))


@pytest.fixture(scope="module")
def want() -> list[Any]:
    model = make_moe("mixtral")
    model.config.output_router_logits = True
    return reference(model, moe_window())[0]


def test_stock_aux_per_micro_batch_is_named_on_every_rank(results: list[Any], want: Any) -> None:
    for rank in results:
        stock = rank["stock"]
        truth = rel_err(stock["update"], want)
        assert not stock["ok"] and stock["patterns"] == (NAMED,), stock["text"]
        assert stock["objective"] == "causal_lm+moe" and stock["ranks"] == (2, 2)
        assert stock["share"] > 0.99 and truth > 1e-2, stock["text"]
        assert stock["error"] == pytest.approx(truth, rel=1e-6)
        # each rank's aux / K, averaged by FSDP2 over the 2 ranks: 1 / (K · world) on the sum
        assert "weight 0.25 on the per-micro-batch term" in stock["diagnosis"]
    assert results[0]["stock"]["error"] == results[1]["stock"]["error"]


def test_window_stats_accumulator_is_right_on_every_rank(results: list[Any], want: Any) -> None:
    for rank in results:
        exact = rank["exact"]
        assert rel_err(exact["update"], want) < 1e-12  # the step is the full batch's
        assert exact["ok"] and exact["patterns"] == ("right",), exact["text"]
        assert exact["objective"] == "causal_lm+moe" and exact["share"] == 0.0
        assert exact["micro_batches"] == 4 and exact["ranks"] == (2, 2)


def test_padding_micro_batches_are_refused_on_every_rank(results: list[Any], want: Any) -> None:
    for rank in results:
        padded = rank["padded"]
        assert rel_err(padded["update"], want) < 1e-12  # the run went on, unchanged
        assert not padded["ok"] and padded["windows"] == 0, padded["problems"]
        (problem,) = padded["problems"]
        assert "fb.Accumulator ran 1 zero-weight padding micro-batch(es)" in problem, problem

"""``fb.probe`` on a tiny float32 Mixtral with its router aux loss under the Hugging Face
Trainer over DeepSpeed ZeRO-3 (every parameter partitioned, 2 gloo ranks on CPU, one process
group): the stock ``Trainer`` (each micro-batch's own aux loss, added undivided) is named "a
window statistic taken per micro-batch" with its fix, its error the one measured here against
a float64 full batch of every rank's rows; ``fullbatch.hf.ExactTrainer`` is right. The probe's
replays take ZeRO-3's backward hooks off the MoE blocks DeepSpeed keeps whole (its leaf
modules) and gather the partitioned parameters on every rank. In the same process group,
``fullbatch.deepspeed.ExactEngine`` on uneven micro-batch counts (3 and 4: a zero-weight padding
micro-batch on rank 0) is refused on every rank, naming why, and its step is still the full
batch's (tests/_probe_moe_ds_cases.py)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

import _probe_moe_ds_cases as cases
from _dist_ds import run_ds, values
from _moe_cases import make_moe, reference, rel_err
from fullbatch._probe._engines import Engine
from fullbatch._probe._fixes import fix
from fullbatch._probe._window_stat import NAMED

pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return values(run_ds(cases.everything, 2, deadline=360))


@pytest.fixture(scope="module")
def want() -> list[Any]:
    model = make_moe("mixtral")
    model.config.output_router_logits = True
    return reference(model, cases.window())[0]


def test_stock_trainer_is_named_on_every_rank(results: list[Any], want: Any) -> None:
    for rank in results:
        stock = rank["stock"]
        truth = rel_err(stock["update"], want)
        assert not stock["ok"] and stock["patterns"] == (NAMED,), stock["text"]
        assert stock["engine"] == "transformers.Trainer" and stock["ranks"] == (2, 2)
        assert stock["objective"] == "causal_lm+moe" and stock["share"] > 0.99
        assert "weight 1 on the per-micro-batch term" in stock["diagnosis"]  # added undivided
        assert "fullbatch.hf.ExactTrainer" in stock["diagnosis"]
        assert truth > 1e-2 and stock["error"] == pytest.approx(truth, rel=1e-5)
    assert results[0]["stock"]["error"] == results[1]["stock"]["error"]


def test_exact_trainer_is_right_on_every_rank(results: list[Any], want: Any) -> None:
    for rank in results:
        exact = rank["exact"]
        assert rel_err(exact["update"], want) < 1e-6  # float32: the full batch's step
        assert exact["ok"] and exact["patterns"] == ("right",), exact["text"]
        assert exact["engine"] == "fullbatch.hf.ExactTrainer" and exact["share"] == 0.0
        assert exact["error"] <= exact["tolerance"]


def test_raw_engine_fix_names_a_route_that_takes_the_window_counts() -> None:
    """A raw DeepSpeed engine: the fix names ExactEngine's window statistic (and the Trainer
    route), never fb.Accumulator, which refuses a DeepSpeed engine."""
    said = fix(NAMED, Engine("DeepSpeed", package="deepspeed"))
    assert "fullbatch.deepspeed.ExactEngine" in said and "window.stats" in said, said
    assert "fullbatch.hf.ExactTrainer" in said and "fb.Accumulator" not in said, said


def test_exact_engine_padding_is_refused_on_every_rank(results: list[Any]) -> None:
    import torch

    import _probe_ds_cases as raw

    model = raw.make_model().double()  # the float64 full batch of both ranks' 7 micro-batches
    micros = raw.micro_batches(0)[:3] + raw.micro_batches(1)
    x = torch.cat([m["x"] for m in micros]).double()
    y = torch.cat([m["y"] for m in micros])
    torch.nn.functional.cross_entropy(model(x), y).backward()
    want = [p.grad for p in model.parameters()]
    for rank in results:
        report, update = rank["padded"]["report"], rank["padded"]["update"]
        assert rel_err([u.double() for u in update], want) < 1e-6  # the run went on, exact
        assert not report.ok and report.windows == (), str(report)
        (problem,) = report.problems
        assert "ExactEngine ran 1 zero-weight padding micro-batch(es)" in problem, problem

"""``fb.probe`` around TRL's ``SFTTrainer`` on tiny float64 Mixtral and Qwen3-MoE models with
their router aux loss on (``router_aux_loss_coef`` 0.25), one window of 4 uneven micro-batches
of 2 rows: the stock trainer (its exact cross-entropy plus each micro-batch's own aux loss over
K) is named "a window statistic taken per micro-batch" with its share and the fix that names
``fullbatch.trl.ExactSFTTrainer``; ``ExactSFTTrainer`` on the same model is right. Each verdict
is checked against the applied gradient's distance (SGD, lr 1: the parameters' move) from a
float64 full batch written in tests/_moe_cases.py."""

from __future__ import annotations

import tempfile
from typing import Any

import pytest

pytest.importorskip("trl")

import fullbatch as fb
from _moe_cases import make_moe, moe_rows, reference, rel_err
from _trl_moe_cases import sft_step
from fullbatch._probe._window_stat import NAMED

LENGTHS = (7, 3, 5, 7, 2, 6, 4, 1)
K = 4


def _probed(exact: bool, family: str = "mixtral") -> tuple[Any, float]:
    """One probed window of the trainer; its report and the step's error against the truth."""
    from trl import SFTTrainer

    from fullbatch.trl import ExactSFTTrainer

    model = make_moe(family)
    model.config.output_router_logits = True  # the model adds coef · aux: objective inferred
    truth = make_moe(family)
    truth.config.output_router_logits = True
    want, _ = reference(truth, moe_rows(LENGTHS, seed=1))
    with tempfile.TemporaryDirectory() as tmp, fb.probe(windows=1) as probe:
        got, _ = sft_step(model, ExactSFTTrainer if exact else SFTTrainer, tmp, LENGTHS, k=K)
    return probe.report, rel_err(got, want)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_stock_sft_trainer_names_the_statistic(family: str) -> None:
    report, truth = _probed(exact=False, family=family)
    (w,) = report.windows
    assert not report.ok and w.engine == "trl.SFTTrainer" and w.objective == "causal_lm+moe"
    assert w.patterns == (NAMED,) and w.micro_batches == K, str(report)
    assert w.statistic_share is not None and w.statistic_share > 0.99, str(report)
    assert all(abs(x - 1) < 1e-4 for x in w.weights), str(report)  # the cross-entropy is exact
    # TRL divides each micro-batch's own aux loss by K: the fitted weight on that term is 1/K
    assert f"weight {1 / K:.3g} on the per-micro-batch term" in w.diagnosis, w.diagnosis
    assert "fullbatch.trl.ExactSFTTrainer in place of trl.SFTTrainer" in w.diagnosis
    assert truth > 1e-2 and w.error == pytest.approx(truth, rel=1e-6), (w.error, truth)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_exact_sft_trainer_is_right(family: str) -> None:
    report, truth = _probed(exact=True, family=family)
    (w,) = report.windows
    assert report.ok and w.pattern == "right", str(report)
    assert w.engine == "fullbatch.trl.ExactSFTTrainer" and w.objective == "causal_lm+moe"
    assert w.statistic_share == 0.0 and w.micro_batches == K
    # TRL's fused LM head takes its log-probabilities in float32 tiles: on this float64 model
    # the step is exact to float32 rounding, which the probe's band measures
    assert truth < 1e-6 and w.error <= w.tolerance, (truth, str(report))

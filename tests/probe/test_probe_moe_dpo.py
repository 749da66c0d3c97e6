"""``fb.probe`` around TRL's ``DPOTrainer`` on a tiny float64 Mixtral with TRL's router aux loss
on (``router_aux_loss_coef`` 0.25): the objective is TRL's DPO loss over the window's pairs plus
``coef`` times the load balancing of all the window's policy forwards (``"dpo+moe"``, what
``fullbatch.trl.ExactDPOTrainer`` trains). One window of 4 micro-batches of 2, 2, 2 and 1 pairs:
the stock trainer (each micro-batch's mean over its pairs and its own aux loss, over K) is named
"a window statistic taken per micro-batch" with its share, the fix naming
``fullbatch.trl.ExactDPOTrainer``; ``ExactDPOTrainer`` is right, and so is the stock trainer
without accumulation (one micro-batch is the full batch). Each verdict is checked against the
step's distance (SGD) from the float64 full batch written in tests/_trl_dpo_moe_cases.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("trl")

import fullbatch as fb
from _trl_cases import windows
from _trl_dpo_moe_cases import reference, run, step_error
from fullbatch._probe._window_stat import NAMED

N, K, BATCH = 7, 4, 2
SOURCE = (
    "(loss_type=['sigmoid'], summed over pairs) with its router aux loss "
    "(router_aux_loss_coef=0.25, top-2: load balancing over the window)"
)


def _probed(*, exact: bool, k: int = K, batch: int = BATCH) -> tuple[Any, float]:
    """One probed window of the trainer: its report and the step's error against the truth."""
    with fb.probe(windows=1) as probe:
        got = run("mixtral", N, k=k, batch=batch, exact=exact)
    before = got["steps"][0]
    want = reference("mixtral", windows(got["seen"], k)[0], before)
    return probe.report, step_error(got["steps"][1], want["after"], before)


def test_stock_dpo_trainer_names_the_statistic() -> None:
    report, truth = _probed(exact=False)
    (w,) = report.windows
    assert not report.ok and w.engine == "trl.DPOTrainer" and w.objective == "dpo+moe"
    assert w.objective_source == f"DPOTrainer {SOURCE}"
    assert w.patterns == (NAMED, "mean of per-micro-batch means"), str(report)
    assert w.statistic_share is not None and w.statistic_share > 0.9, str(report)
    # each micro-batch's DPO mean over its own pairs, over K: (1/K) / (P_k / P) = 7/8, 7/4
    assert w.weights == pytest.approx((0.875, 0.875, 0.875, 1.75), rel=1e-5), str(report)
    # TRL adds each micro-batch's own aux loss and the Trainer divides by K: weight 1/K on it
    assert f"weight {1 / K:.3g} on the per-micro-batch term" in w.diagnosis, w.diagnosis
    assert (
        "Fix: take the routing counts over the whole window: use fullbatch.trl.ExactDPOTrainer "
        "in place of trl.DPOTrainer"
    ) in w.diagnosis, w.diagnosis
    assert truth > 1e-2 and w.error == pytest.approx(truth, rel=1e-4), (w.error, truth)


def test_exact_dpo_trainer_is_right() -> None:
    report, truth = _probed(exact=True)
    (w,) = report.windows
    assert report.ok and w.pattern == "right", str(report)
    assert w.engine == "fullbatch.trl.ExactDPOTrainer" and w.objective == "dpo+moe"
    assert w.objective_source == f"fullbatch.trl.ExactDPOTrainer {SOURCE}"
    assert w.statistic_share == 0.0 and w.micro_batches == K
    # TRL's fused LM head takes its log-probabilities in float32: the step is exact to that
    # rounding, which the probe's band measures
    assert truth < 1e-6 and w.error <= w.tolerance, (truth, str(report))


def test_stock_dpo_trainer_without_accumulation_is_right() -> None:
    """One micro-batch of all the pairs: its own routing counts are the window's."""
    report, truth = _probed(exact=False, k=1, batch=N)
    (w,) = report.windows
    assert report.ok and w.pattern == "right" and w.objective == "dpo+moe", str(report)
    assert w.micro_batches == 1 and w.count == N
    assert truth < 1e-6 and w.error <= w.tolerance, (truth, str(report))


def test_probed_dpo_moe_run_is_unchanged() -> None:
    """The probe's pre-pass, aux columns and replays of TRL's loss touch neither the training
    nor its logs: the probed stock run is bitwise the unprobed one."""
    import torch

    plain = run("mixtral", N, k=K, batch=BATCH, exact=False)
    with fb.probe(windows=1) as probe:
        probed = run("mixtral", N, k=K, batch=BATCH, exact=False)
    assert not probe.report.ok  # it was checked (and is wrong)
    after, again = plain["steps"][1], probed["steps"][1]
    assert all(torch.equal(after[n], again[n]) for n in after)
    assert plain["logs"] == probed["logs"]


def _trainer(**attributes: Any) -> Any:
    """A ``trl.DPOTrainer`` not constructed: only the attributes its objective reads."""
    from trl import DPOTrainer

    trainer = object.__new__(DPOTrainer)
    trainer.__dict__.update(attributes)
    return trainer


def test_the_objective_needs_the_window_and_a_top_k() -> None:
    """Without the probe's pre-pass the objective says what it needs; a MoE config without
    experts per token is refused before anything trains."""
    from fullbatch._probe._moe_objective import routed_of
    from fullbatch.trl._objective import CannotJudge, dpo_objective

    def model(**config: Any) -> Any:
        text = SimpleNamespace(**config)
        return SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: text))

    def trainer(**config: Any) -> Any:
        accelerator = SimpleNamespace(unwrap_model=lambda m: m)
        return _trainer(
            loss_types=["sigmoid"], args=None, aux_loss_enabled=True, router_aux_loss_coef=0.5,
            accelerator=accelerator, model=model(**config),
        )  # fmt: skip

    fn, what = dpo_objective(trainer(num_experts_per_tok=2))
    routed = routed_of(fn)
    assert routed is not None and (routed.aux().coef, routed.aux().top_k) == (0.5, 2)
    assert fn.__name__ == "dpo+moe" and what == "loss_type=['sigmoid'], summed over pairs"
    with pytest.raises(CannotJudge, match="needs the window's routing counts"):
        fn(None, {})
    with pytest.raises(CannotJudge, match=r"no experts per token \(num_experts_per_tok=None\)"):
        dpo_objective(trainer())


@pytest.mark.timeout(300)
def test_dpo_moe_probe_over_two_ranks() -> None:
    """2 gloo DDP ranks, 2 micro-batches of 2 pairs each: the probe's pre-pass sums the routing
    counts over the ranks, so ExactDPOTrainer is right and the stock trainer's aux loss per
    micro-batch is named on every rank, its error the one measured against the float64 full
    batch of both ranks' pairs."""
    from _dist import run_ranks, values
    from _trl_dpo_moe_cases import probed_ddp_rank

    ranks = values(run_ranks(probed_ddp_rank, 2, 8, 2, 2, pg_timeout=60.0, deadline=240.0))
    for name in ("exact", "stock"):
        rows = [r for got in ranks for r in windows(got[name]["seen"], 2)[0]]
        assert len(rows) == 8
        before = ranks[0][name]["steps"][0]
        want = reference("mixtral", rows, before)
        for got in (rank[name] for rank in ranks):
            truth = step_error(got["steps"][1], want["after"], before)
            assert got["world"] == 2 and got["objective"] == "dpo+moe"
            if name == "exact":
                assert got["ok"] and truth < 1e-6 and got["share"] == 0.0, got["patterns"]
            else:
                assert not got["ok"] and got["patterns"] == (NAMED,), got["patterns"]
                assert got["share"] > 0.99 and got["error"] == pytest.approx(truth, rel=1e-4)

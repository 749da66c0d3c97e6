"""fullbatch.trl.ExactDPOTrainer on a transformers MoE model with TRL's router aux loss: the
step is the full batch's, ``w · mean over the window's pairs of -log σ(β Δ)`` plus
``router_aux_loss_coef`` times the load-balancing loss of the whole window's policy forwards
(every pair's chosen and rejected sequence, padding left out), written in plain PyTorch in
tests/_trl_dpo_moe_cases.py; the stock ``trl.DPOTrainer`` adds each micro-batch's own.

Tolerances, measured (``torch.set_num_threads(1)`` as under pytest, Mixtral, OLMoE and
Qwen3-MoE): the models are float64 but not float64 inside (transformers casts their RMSNorm,
router softmax and eager attention softmax to float32), and TRL's fused LM head computes the
log-probabilities in float32. The whole step is 6.1e-8 to 6.3e-8 from the float64 reference
(``TOL`` = 5e-7). With the DPO term weighted by zero (``loss_weights=[0.0]``) the step is the
aux term's alone, 3e-12 to 1.1e-9 from the reference (1e-15 on 2 threads; float32 roundings
that flip with the batch's shape), held to ``TOL_AUX`` = 1e-8. A per-micro-batch aux term is
1.4e-3 to 4e-3 off (with the DPO term) and 4e-2 (alone), far outside both. The logged
aux_loss is the window's to 1e-12 (no float32 in it)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("trl")

from _dist import run_ranks, values
from _trl_cases import windows
from _trl_dpo_moe_cases import (
    FAMILIES,
    LAYERS,
    ddp_rank,
    per_micro_step,
    reference,
    run,
    step_error,
    tokens,
)

TOL, TOL_AUX = 5e-7, 1e-8
N, K, BATCH = 7, 4, 2  # 7 pairs: micro-batches of 2, 2, 2 and 1 pairs, each padded its own way


def _check_prepasses(got: dict, wins: list[list[dict]]) -> None:
    """One routing pre-pass per window, counting each routed token of it once (all layers)."""
    assert [p["items"] for p in got["prepasses"]] == [len(rows) for rows in wins]
    assert [p["rows"] for p in got["prepasses"]] == [LAYERS * tokens(rows) for rows in wins]
    assert all(p["seconds"] > 0 for p in got["prepasses"])


@pytest.mark.parametrize("family", FAMILIES)
def test_exact_dpo_moe_step_equals_full_batch(family: str) -> None:
    """Four uneven padded micro-batches: the step equals the full batch's (DPO term and the
    window's load-balancing term); the logged aux_loss is the window's. OLMoE: the coefficient
    from the DPOConfig (not the model config's 0.25) and the config's output_router_logits on."""
    coef, options = 0.25, {}
    if family == "olmoe":
        coef, options = 0.5, {"router_aux_loss_coef": 0.5, "router_logits": True}
    got = run(family, N, k=K, batch=BATCH, **options)
    rows = windows(got["seen"], K)[0]
    assert [len(m) for m in got["seen"]] == [2, 2, 2, 1]
    before = got["steps"][0]
    want = reference(family, rows, before, coef=coef)
    assert step_error(got["steps"][1], want["after"], before) < TOL
    # the check sees the aux term's window: a per-micro-batch one is far outside TOL
    per_micro = per_micro_step(family, got["seen"], before, coef=coef)
    assert step_error(per_micro, want["after"], before) > 1e3 * TOL
    logged = [h["aux_loss"] for h in got["logs"]]
    assert len(logged) == 1 and abs(logged[0] - want["aux"]) < 1e-12 * want["aux"], logged
    _check_prepasses(got, [rows])


def test_exact_dpo_moe_aux_term_alone_with_gradient_checkpointing() -> None:
    """The aux term alone (DPO weighted by zero), two windows, gradient checkpointing (the
    recomputed forwards must not count again): each step is the full batch's within
    ``TOL_AUX``, one pre-pass per window counting its own tokens once."""
    got = run("mixtral", 2 * N + 1, k=K, batch=BATCH, max_steps=2, loss_weights=[0.0],
              gradient_checkpointing=True)  # fmt: skip
    wins = windows(got["seen"], K)
    assert len(wins) == 2 and len(got["steps"]) == 3
    for w, rows in enumerate(wins):
        before = got["steps"][w]
        want = reference("mixtral", rows, before, weight=0.0)
        assert step_error(got["steps"][w + 1], want["after"], before) < TOL_AUX, w
    _check_prepasses(got, wins)


def test_stock_dpo_moe_step_is_off() -> None:
    """The control: TRL's DPOTrainer adds each micro-batch's own load-balancing loss (aux term
    alone, so its pair weighting is not what is measured)."""
    got = run("mixtral", N, k=K, batch=BATCH, exact=False, loss_weights=[0.0])
    before = got["steps"][0]
    want = reference("mixtral", windows(got["seen"], K)[0], before, weight=0.0)
    assert step_error(got["steps"][1], want["after"], before) > 1e-2
    assert got["prepasses"] == []


def test_exact_dpo_moe_without_aux_has_no_prepass() -> None:
    """``router_aux_loss_coef=0.0`` in the DPOConfig turns the aux loss off (TRL's rule): no
    pre-pass, no aux_loss logged, the step is the DPO term's alone."""
    got = run("mixtral", N, k=K, batch=BATCH, router_aux_loss_coef=0.0)
    before = got["steps"][0]
    want = reference("mixtral", windows(got["seen"], K)[0], before, coef=0.0)
    assert step_error(got["steps"][1], want["after"], before) < TOL
    assert got["prepasses"] == [] and "aux_loss" not in got["logs"][0]


def test_exact_dpo_moe_two_ddp_ranks() -> None:
    """Two gloo ranks, two micro-batches of 2 pairs each (padded their own way): the routing
    counts and pairs are the window's over both ranks; every rank's step is the full batch's."""
    ranks = values(run_ranks(ddp_rank, 2, "mixtral", 8, 2, 2, pg_timeout=60.0, deadline=240.0))
    rows = [r for got in ranks for r in windows(got["seen"], 2)[0]]
    assert len(rows) == 8
    before = ranks[0]["steps"][0]
    want = reference("mixtral", rows, before)
    for rank, got in enumerate(ranks):
        assert got["world"] == 2
        assert step_error(got["steps"][1], want["after"], before) < TOL, rank
        assert abs(got["logs"][0]["aux_loss"] - want["aux"]) < 1e-12 * want["aux"], rank
        _check_prepasses(got, [rows])


def test_policy_router_logits_refused_unless_seen_once() -> None:
    """A forward that hands back no router logits, or more than the policy's and a PEFT
    reference's (without gradient), is refused, naming what was seen and the fix."""
    from fullbatch.trl import ExactDPOTrainer

    policy = ExactDPOTrainer._policy_logits
    graph, frozen = [torch.ones(2, requires_grad=True)], [torch.ones(2)]
    assert policy([graph, frozen]) is graph
    for seen in ([], [graph, graph], [graph, frozen, frozen]):
        with pytest.raises(ValueError, match=rf"{len(seen)} times.*router_aux_loss_coef=0\.0"):
            policy(seen)


def test_check_trainer_judges_the_dpo_moe_aux_loss(tmp_path: Any) -> None:
    """``fullbatch.hf.check_trainer``, whose full batch is TRL's DPO loss with the whole
    window's load-balancing loss: ExactDPOTrainer passes, the stock DPOTrainer fails, naming
    the aux loss (the model config's ``output_router_logits`` on: what the check reads)."""
    import warnings

    from trl import DPOTrainer

    import fullbatch.hf as fbhf
    from _trl_dpo_cases import dpo_config, pairs
    from _trl_dpo_moe_cases import moe_lm
    from fullbatch._demo._trl_tiny import char_tokenizer
    from fullbatch.trl import ExactDPOTrainer

    checks = {}
    for cls in (ExactDPOTrainer, DPOTrainer):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = cls(
                model=moe_lm("mixtral", router_logits=True),
                ref_model=moe_lm("mixtral", router_logits=True),
                args=dpo_config(str(tmp_path), k=4, batch=2),
                train_dataset=pairs(8),
                processing_class=char_tokenizer(),
            )
            checks[cls] = fbhf.check_trainer(trainer)
    exact, stock = checks[ExactDPOTrainer], checks[DPOTrainer]
    assert exact.passed and exact.band < 1e-6, exact
    assert not stock.passed and stock.accumulated.global_rel_error > 1e-3, stock
    assert "MoE load-balancing loss is each micro-batch's" in stock.reason, stock.reason

"""``window.stats`` on ``fullbatch.deepspeed.ExactEngine``'s windows: a tiny Mixtral's
load-balancing loss exact over the window and both ranks, at ZeRO-2 and ZeRO-3.

Two gloo ranks in one launch (tests/_ds_moe_cases.py): two windows of 3 micro-batches of
uneven rows; in the last, rank 1 holds one and runs two padding ones. Every rank's step (SGD
lr=1: the parameter change) equals the gradient of the float64 full batch written in
tests/_moe_cases.py (token-mean cross-entropy + coef · transformers' load-balancing loss
over the whole window, checked there against the model's own loss), taken at the parameters
that step started from. DeepSpeed refuses float64 gradients, so the engines run float32 and
the band is float32's (BAND; measured 2.2e-7 to 2.7e-7 at ZeRO-2 and ZeRO-3). The control, each
micro-batch's own aux loss averaged (what the model computes per forward), is 5.3e-2 off,
so the band can fail.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

import _ds_moe_cases as cases
import _moe_cases as moe
from _dist_ds import run_ds, values

pytestmark = pytest.mark.timeout(600)

RUNS = [(2, True), (3, True), (2, False)]
BAND = 2e-6


@pytest.fixture(scope="module")
def trained() -> list[dict[Any, Any]]:
    return values(run_ds(cases.train_all, 2, RUNS, deadline=400))


def _full_batch_grad(params: list[torch.Tensor], window: int) -> list[torch.Tensor]:
    """The float64 full batch's gradient of ``window`` at ``params``."""
    model = moe.make_moe("mixtral")
    with torch.no_grad():
        for p, value in zip(model.parameters(), params, strict=True):
            p.copy_(value)
    grads, _ = moe.reference(model, cases.window_rows(window))
    return grads


def _step_error(res: dict[str, Any], window: int) -> float:
    before, after = res["before"][window], res["after"][window]
    applied = [b - a for b, a in zip(before, after, strict=True)]
    return moe.rel_err(applied, _full_batch_grad(before, window))


@pytest.mark.parametrize("stage", [2, 3])
def test_every_rank_steps_like_the_full_batch(trained: list[dict[Any, Any]], stage: int) -> None:
    for rank, results in enumerate(trained):
        res = results[(stage, True)]
        assert len(res["after"]) == len(cases.SIZES)
        for w in range(len(cases.SIZES)):
            err = _step_error(res, w)
            assert err < BAND, (stage, rank, w, err)
            assert not res["stats"][w].skipped
            assert res["stats"][w].stats_seconds > 0
        # the same parameters on both ranks after every step
        for a, b in zip(res["after"][-1], trained[0][(stage, True)]["after"][-1], strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("stage", [2, 3])
def test_the_pre_pass_runs_once_per_window(trained: list[dict[Any, Any]], stage: int) -> None:
    """One no-grad forward per micro-batch, once per window (a second call returns the kept
    value). Under ZeRO-3 (forwards all-gather) rank 1 also runs its padding micro-batch."""
    for rank, results in enumerate(trained):
        res = results[(stage, True)]
        want = [list(sizes[rank]) for sizes in cases.SIZES]
        if stage == 3 and rank == 1:
            want[1] += want[1][-1:] * 2  # the padding micro-batches: its last one again
        assert res["calls"] == want, (stage, rank)
        assert res["same"]


@pytest.mark.parametrize("stage", [2, 3])
def test_a_concatenated_statistic_holds_every_rank_s_rows_in_order(
    trained: list[dict[Any, Any]], stage: int
) -> None:
    """``reduce="cat"``: the window's real rows over both ranks, rank 0's first (padding
    micro-batches left out), the same on every rank."""
    for results in trained:
        for w, got in enumerate(results[(stage, True)]["lengths"]):
            rows = sum(sum(sizes) for sizes in cases.SIZES[w])
            assert got.tolist() == list(cases.LENGTHS[:rows]), (stage, w)


def test_a_statistic_after_the_first_backward_is_refused(trained: list[dict[Any, Any]]) -> None:
    for results in trained:
        for stage in (2, 3):
            (late,) = results[(stage, True)]["late"]
            assert "after its micro-batches began (1 yielded, 1 backward call(s))" in late
            assert "before `for micro in window:`" in late


def test_the_per_micro_batch_aux_loss_is_off(trained: list[dict[Any, Any]]) -> None:
    """The control: each micro-batch's own routing counts (the model's per-forward loss)."""
    for results in trained:
        err = _step_error(results[(2, False)], 0)
        assert err > 1e-3, err


class _Engine:
    """What ``engine_stats`` asks of a DeepSpeed engine (one process, no group)."""

    def __init__(self, stage: int) -> None:
        self.stage = stage
        self.module = torch.nn.BatchNorm1d(2)
        self.device = torch.device("cpu")

    def zero_optimization_stage(self) -> int:
        return self.stage


def _too_big(calls: list[int]) -> Any:
    def fn(micro: torch.Tensor) -> torch.Tensor:
        calls.append(micro.shape[0])
        if micro.shape[0] > 1:
            raise torch.OutOfMemoryError(f"{micro.shape[0]} rows do not fit")
        return micro.sum(0)

    return fn


def test_out_of_memory_below_zero_3_runs_the_micro_batch_in_halves() -> None:
    from fullbatch._wings._deepspeed import engine_stats

    calls: list[int] = []
    micros = [torch.arange(8.0).reshape(4, 2), torch.ones(1, 2)]
    got = engine_stats(_Engine(2), micros, 2, _too_big(calls), "sum")
    assert got.tolist() == [13.0, 17.0]  # the sum of every row, as without the error
    assert calls == [4, 2, 1, 1, 2, 1, 1, 1]


def test_out_of_memory_at_zero_3_names_the_fix_without_halves() -> None:
    """ZeRO-3's forwards all-gather on every rank: halves on one rank would leave the others
    waiting, so the error propagates at once, naming why and the fix."""
    from fullbatch._wings._deepspeed import engine_stats

    calls: list[int] = []
    with pytest.raises(torch.OutOfMemoryError, match=r"ZeRO-3's parameter all-gathers .* loader"):
        engine_stats(_Engine(3), [torch.ones(4, 2)], 1, _too_big(calls), "sum")
    assert calls == [4]


def test_zero_3_runs_the_padding_forwards_and_drops_them() -> None:
    """A rank holding 1 of the window's 3 micro-batches runs 3 forwards at ZeRO-3 (its last
    micro-batch again, as the window yields it) and 1 below; the statistic is the real one's,
    and the BatchNorm buffers and RNG state are as before."""
    from fullbatch._wings._deepspeed import engine_stats

    for stage, forwards in ((2, 1), (3, 3)):
        engine = _Engine(stage)
        calls: list[int] = []

        def fn(micro: torch.Tensor, calls: list[int] = calls, engine: _Engine = engine) -> Any:
            calls.append(micro.shape[0])
            return {"rows": engine.module(micro + torch.rand(1)).sum(0)}

        micro = torch.randn(3, 2)
        rng = torch.get_rng_state()
        got = engine_stats(engine, [micro], 3, fn, "sum")
        assert len(calls) == forwards
        assert got["rows"].dtype == torch.float64
        assert torch.equal(engine.module.running_mean, torch.zeros(2))  # moved, put back
        assert torch.equal(torch.get_rng_state(), rng)  # fn's torch.rand draws were undone
        cat = engine_stats(engine, [micro, micro[:1]], 3, lambda m: m[:, 0], "cat")
        assert torch.equal(cat, torch.cat([micro[:, 0], micro[:1, 0]]))

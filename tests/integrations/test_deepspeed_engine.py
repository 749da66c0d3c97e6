"""fullbatch.deepspeed.ExactEngine on a raw DeepSpeed engine, 1 and 2 gloo ranks (CPU).

ZeRO stages 0-3, with and without CPU offload, DeepSpeed's own clip on (0.3, below the
gradient's norm): every rank's parameters after every step equal a plain float64 full batch
over every rank's rows of that window (tests/_ds_cases.py), for two windows — uneven rows,
``-100`` labels, ranks holding 2 and 1 micro-batches in the partial last one (a padding
micro-batch). DeepSpeed refuses float64 gradients in its reductions, so the engines run in
float32 and the band is float32's: 1e-5 relative to the update (measured: ~4e-8 on the
parameters). The stock per-micro-batch mean through ``engine.backward`` is far outside it.
The same holds for ``ExactEngine`` on the engine Accelerate's DeepSpeed plugin prepares
(``accelerator.prepare``), which ``fb.Accumulator`` refuses.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("deepspeed")

import _ds_cases as cases
from _dist import one_of, several
from _dist_ds import run_ds, values

pytestmark = pytest.mark.timeout(600)

RUNS = (
    [
        (stage, offload, 0.3, torch.float32, "exact")
        for stage in (0, 1, 2, 3)
        for offload in ((False,) if stage == 0 else (False, True))
    ]
    + [
        (stage, offload, 0.3, torch.float32, "accelerate")
        for stage, offload in ((0, False), (2, True), (3, False))
    ]
    + [(2, False, 0.0, torch.float32, "stock")]
)
BAND = 1e-5


def update_error(
    got: list[torch.Tensor], ref: list[torch.Tensor], start: list[torch.Tensor]
) -> float:
    diff = sum(float((g - r).pow(2).sum()) for g, r in zip(got, ref, strict=True))
    moved = sum(float((r - s).pow(2).sum()) for r, s in zip(ref, start, strict=True))
    return (diff / moved) ** 0.5


@pytest.fixture(scope="module", params=[1, 2], ids=["1-rank", "2-ranks"])
def trained(request: Any) -> tuple[int, list[dict[Any, Any]]]:
    world = request.param
    return world, values(run_ds(cases.train_all, world, RUNS, deadline=400))


def test_every_stage_steps_like_the_full_batch(trained: tuple[int, list[dict[Any, Any]]]) -> None:
    world, results = trained
    start = [p.detach().double() for p in cases.make_model(torch.float64).parameters()]
    for run in RUNS:
        _stage, _offload, clip, _, route = run
        if route == "stock":
            continue
        ref = cases.reference(world, clip)
        for rank, res in enumerate(results):
            got = res[run]
            assert len(got["params"]) == 2
            for step in range(2):
                before = start if step == 0 else ref[step - 1]
                err = update_error(got["params"][step], ref[step], before)
                assert err < BAND, (run, rank, step, err)
            stats = got["stats"]
            assert [s.skipped for s in stats] == [False, False]
            assert [s.steps for s in stats] == [1, 2]
            windows = cases.windows_of(world)
            counts = [sum(int((m["y"] != -100).sum()) for m in w) for w in windows]
            assert [s.count for s in stats] == counts
            # ranks hold 2 and 1 micro-batches in the partial window: rank 1 pads
            want = [[False] * 4, [False, rank == 1]]
            assert got["padding"] == want, (run, rank)
        # every rank holds the same parameters
        for res in results[1:]:
            for a, b in zip(res[run]["params"][1], results[0][run]["params"][1], strict=True):
                assert torch.equal(a, b), run


def test_stock_mean_of_means_is_off(trained: tuple[int, list[dict[Any, Any]]]) -> None:
    """The same engine with a per-micro-batch mean through engine.backward (DeepSpeed's own
    1/GA): the test above would fail on it."""
    world, results = trained
    run = RUNS[-1]
    start = [p.detach().double() for p in cases.make_model(torch.float64).parameters()]
    ref = cases.reference(world, 0.0)
    err = update_error(results[0][run]["params"][0], ref[0], start)
    assert err > 0.1, err


SKIPS = [(0, False), (2, True), (3, False)]


@pytest.fixture(scope="module")
def skipped() -> list[Any]:
    """Every stage of :data:`SKIPS` on one launch of 2 ranks (:func:`_dist.several`)."""
    calls = [(cases.skips, run) for run in SKIPS]
    return values(run_ds(several, 2, calls, deadline=500))


@pytest.mark.parametrize(("stage", "offload"), SKIPS)
def test_non_finite_and_empty_windows_are_skipped(
    stage: int, offload: bool, skipped: list[Any]
) -> None:
    """A NaN input on the last rank, or a window whose labels are all -100: skipped on every
    rank (DeepSpeed's own overflow skip at ZeRO 1-3; fullbatch's at stage 0; before any
    forward for zero items), parameters and momentum unchanged, one warning; the next window
    steps."""
    results = one_of(skipped, SKIPS.index((stage, offload)))
    reasons = {"nan": "non-finite loss", "no_items": "no items counted in the window"}
    for rank, res in enumerate(results):
        for mode, reason in reasons.items():
            r = res[mode]
            assert [s.reason for s in r["stats"]] == [None, reason, None], (rank, mode)
            assert r["steps"] == (2, 1)
            for a, b in zip(r["params"][1], r["params"][0], strict=True):
                assert torch.equal(a, b), (rank, mode)
            for a, b in zip(r["state"][1], r["state"][0], strict=True):
                assert torch.equal(a, b), (rank, mode)
            assert any(
                not torch.equal(a, b) for a, b in zip(r["params"][2], r["params"][1], strict=False)
            )
            assert len(r["warnings"]) == 1 and r["warnings"][0].startswith(
                f"window 1 was skipped ({reason})"
            )
            assert r["ran"][1] == (0 if mode == "no_items" else 4)


@pytest.fixture(scope="module")
def refused() -> list[Any]:
    """The two refusals below on one launch of 1 rank (:func:`_dist.several`)."""
    calls = [(cases.accumulator_refuses, ()), (cases.mismatch, ())]
    return values(run_ds(several, 1, calls, deadline=200))


def test_fb_accumulator_refuses_accelerates_deepspeed_engine(refused: list[Any]) -> None:
    """fullbatch's Accelerate route (fb.Accumulator on what accelerator.prepare returns) cannot
    rescale gradients DeepSpeed has partitioned: it refuses the engine and names ExactEngine,
    which the runs above prove exact on the same prepared engine."""
    (out,) = one_of(refused, 0)
    assert "is a DeepSpeed engine (DeepSpeedEngine)" in out, out
    assert "fullbatch.deepspeed.ExactEngine" in out and "unchanged=True" in out, out


def test_a_count_that_disagrees_with_the_loss_is_refused(refused: list[Any]) -> None:
    (out,) = one_of(refused, 1)
    assert "differ from count(micro)" in out and "unchanged=True" in out, out

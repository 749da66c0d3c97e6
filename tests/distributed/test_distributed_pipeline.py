"""Pipeline parallelism (GPipe, 1F1B, interleaved 1F1B) with DP x PP = 2 x 2 on 4 gloo ranks,
one process group: every rank after every step against the whole model trained on the full
batch (float64), uneven data-parallel ranks, collectives counted, refusals."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import _dist_pipe as cases
from _dist import run_ranks, values
from fullbatch._base._versions import PIPELINE_TORCH, torch_version

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        torch_version() < PIPELINE_TORCH,
        reason=f"fullbatch.Pipeline needs torch >= 2.7 (scale_grads), found {torch.__version__}",
    ),
]

TOL = 1e-12  # measured: worst 1.3e-16 relative over every schedule and step
KINDS = ["gpipe", "1f1b", "interleaved"]


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return values(run_ranks(cases.pipe_cases, 4, deadline=240, pg_timeout=60))


def _assembled(results: list[dict], kind: str, step: int) -> torch.Tensor:
    """The whole model after ``step``: stage blocks from every rank (DP replicas bitwise equal)."""
    blocks: dict[int, torch.Tensor] = {}
    for rank, res in enumerate(results):
        for i, flat in res[kind]["params"][step].items():
            if i in blocks:
                assert torch.equal(blocks[i], flat), (kind, rank, i, step)
            blocks[i] = flat
    assert sorted(blocks) == [0, 1, 2, 3]
    return torch.cat([blocks[i] for i in range(4)])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("kind", KINDS)
def test_pipeline_exact_on_every_rank_after_every_step(results: list[dict], kind: str) -> None:
    ref = cases.pipe_reference()
    for step in range(cases.WINDOWS):
        got = _assembled(results, kind, step)
        detail = [  # on failure: which rank's blocks, and what each rank counted
            (
                rank,
                i,
                _rel(t, ref["params"][step][i]),
                [(s.count, s.grad_norm) for s in r[kind]["stats"]],
            )
            for rank, r in enumerate(results)
            for i, t in r[kind]["params"][step].items()
        ]
        diag = [r[kind].get("diag") for r in results]
        assert _rel(got, torch.cat(ref["params"][step])) < TOL, (kind, step, detail, diag)
    for rank, res in enumerate(results):
        stats = res[kind]["stats"]
        assert [s.count for s in stats] == ref["counts"]  # known before the loss, DP-summed
        for s, norm, loss in zip(stats, ref["norms"], ref["losses"], strict=True):
            assert abs(s.grad_norm - norm) / norm < TOL  # clipped at 0.5: the norm matters
            assert abs(s.loss - loss) / loss < TOL, (s.loss, loss)  # the full-batch loss
        # DP index 0 runs 2 schedule steps per window (8 pipeline micro-batches), index 1 one.
        assert [s.micro_batches for s in stats] == [4 * cases.CALLS[rank // 2]] * 2


@pytest.mark.parametrize("kind", KINDS)
def test_pipeline_collectives_counted_per_window(results: list[dict], kind: str) -> None:
    for res in results:
        for window in res[kind]["counts"]:
            # the window's count and the step's stats over the job; one gradient bucket
            # summed over the data-parallel ranks; nothing over the pipeline group.
            assert window == {"ar:world": 2, "ar:dp": 1}, window


def test_grad_scaler_equals_the_unscaled_full_batch_and_skips_on_every_stage(
    results: list[dict],
) -> None:
    """1F1B with a GradScaler (CPU, float64, growth every step): an inf forced into stage 0 on
    one DP rank skips that window on every stage and rank (stage 1's own gradients were
    finite), every scaler backs off alike; the windows after it equal the unscaled float64
    full batch (power-of-two scales: exact)."""
    ref = cases.pipe_reference()
    initial = cases.make_blocks()
    for rank, res in enumerate(results):
        case = res["scaler-1f1b"]
        skipped = case["skipped_stats"]
        assert skipped.skipped and skipped.reason == "non-finite gradient", (rank, skipped)
        for i, flat in case["skipped_params"].items():  # nothing moved anywhere
            assert torch.equal(flat, torch.cat([p.reshape(-1) for p in initial[i].parameters()]))
        # 2**10, backed off to 2**9 on the skip, then grown once per stepped window.
        assert case["scale"] == [2.0**9, 2.0**10, 2.0**11], (rank, case["scale"])
        assert [s.skipped for s in case["stats"]] == [False] * cases.WINDOWS
        for s, norm, loss in zip(case["stats"], ref["norms"], ref["losses"], strict=True):
            assert abs(s.grad_norm - norm) / norm < TOL  # unscaled before the norm and clip
            assert abs(s.loss - loss) / loss < TOL, (s.loss, loss)  # the unscaled loss
    for step in range(cases.WINDOWS):
        got = _assembled(results, "scaler-1f1b", step)
        assert _rel(got, torch.cat(ref["params"][step])) < TOL, step
        assert torch.equal(got, _assembled(results, "1f1b", step))  # bitwise: unscaled run


def test_torch_default_mean_loss_with_scale_grads_is_not_the_full_batch(
    results: list[dict],
) -> None:
    ref = cases.pipe_reference(max_grad_norm=float("inf"))
    got = _assembled(results, "naive-1f1b", cases.WINDOWS - 1)
    assert _rel(got, torch.cat(ref["params"][-1])) > 0.01  # what Pipeline refuses


def test_pipeline_refusals_name_the_fix(results: list[dict]) -> None:
    for res in results:
        errors = res["refusals"]
        assert "scale_grads=False" in errors["scale_grads"]
        assert "PipelineLoss" in errors["mean_loss"] and "mean of means" in errors["mean_loss"]
        assert "has no get_scale, unscale_, step, update" in errors["scaler"]
        assert "torch.amp.GradScaler" in errors["scaler"]  # the fix

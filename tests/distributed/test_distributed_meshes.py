"""Composed meshes on gloo CPU ranks: tensor parallelism alone (2 ranks), FSDP2 on "dp" x
TP on "tp" (2 x 2) and HSDP x TP (2 x 1 x 2, 4 ranks), each world's cases in one process
group. Every rank after every step against a float64 full batch (uneven items over the data
ranks, with and without a clip that bites), the count and norm reported, and fullbatch's
collectives counted per window."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import _dist_mesh as cases
from _dist import run_ranks, values

pytestmark = [pytest.mark.timeout(300), pytest.mark.fsdp2]

# Measured rounding band: the worst relative error over every case was 3.2e-16 (float64).
TOL = 1e-12


@pytest.fixture(scope="module")
def tp() -> list[dict[str, Any]]:
    return values(run_ranks(cases.tp_cases, 2, deadline=240, pg_timeout=60))


@pytest.fixture(scope="module")
def fsdp_tp() -> list[dict[str, Any]]:
    return values(run_ranks(cases.fsdp_tp_cases, 4, deadline=240, pg_timeout=60))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _check(results: list[dict[str, Any]], name: str, opt: str, options: dict, dp: int) -> None:
    ref = cases.reference(opt, options.get("max_grad_norm"), dp)
    if options.get("max_grad_norm"):  # the clip bites on every step
        assert min(ref["norms"]) > options["max_grad_norm"]
    for rank, res in enumerate(results):
        case = res[name]
        assert case["warnings"] == [], (name, rank, case["warnings"])
        assert len(case["params"]) == len(ref["params"]) == 3
        for step, (got, want) in enumerate(zip(case["params"], ref["params"], strict=True)):
            assert torch.equal(got, results[0][name]["params"][step]), (name, rank, step)
            assert _rel(got, want) < TOL, (name, rank, step, _rel(got, want))
        stats = case["stats"]
        assert [s.count for s in stats] == ref["counts"], (name, rank)  # not x tp
        for s, norm in zip(stats, ref["norms"], strict=True):
            assert abs(s.grad_norm - norm) / norm < TOL, (name, rank, s.grad_norm, norm)


@pytest.mark.parametrize("name", list(cases.CASES))
def test_tensor_parallel_alone_is_the_full_batch_on_every_rank(tp: list, name: str) -> None:
    opt, options = cases.CASES[name]
    _check(tp, name, opt, options, dp=1)
    for res in tp:
        assert res[name]["divisor"] == 1.0
        # One reduction per window (loss, count, norm together) over the "tp" ranks.
        assert res[name]["counts"] == [{"ar:world": 1}] * 3


@pytest.mark.parametrize("name", list(cases.FSDP_CASES))
def test_fsdp2_x_tensor_parallel_is_the_full_batch_on_every_rank(fsdp_tp: list, name: str) -> None:
    opt, options = cases.FSDP_CASES[name]
    _check(fsdp_tp, name, opt, options, dp=2)
    per_micro = options.get("fsdp_sync") == "micro_batch"
    for res in fsdp_tp:
        assert res[name]["divisor"] == 2.0  # FSDP2 averages over "dp" only, not "dp" x "tp"
        for counts, stats in zip(res[name]["counts"], res[name]["stats"], strict=True):
            # fullbatch's own: one reduction over all ranks per window.
            assert counts["ar:world"] == 1, counts
            assert counts["rs:dp"] == (stats.micro_batches if per_micro else 1), counts
            assert "ar:dp" not in counts and "rs:tp" not in counts and "ar:tp" not in counts


@pytest.mark.parametrize("name", list(cases.HSDP_CASES))
def test_hsdp_x_tensor_parallel_is_the_full_batch_on_every_rank(fsdp_tp: list, name: str) -> None:
    opt, options = cases.HSDP_CASES[name]
    _check(fsdp_tp, name, opt, options, dp=2)
    for res in fsdp_tp:
        assert res[name]["divisor"] == 2.0  # replicate x shard, not x "tp"
        for counts in res[name]["counts"]:
            assert counts["ar:world"] == 1, counts  # the one reduction, over every rank
            assert "ar:tp" not in counts and "rs:tp" not in counts, counts


def test_data_mesh_dims_naming_a_model_dim_is_refused(tp: list, fsdp_tp: list) -> None:
    for res in tp:
        assert "data_mesh_dims=('tp',)" in res["named-wrong"]
        assert "no wrapper reduces gradients over the dims []" in res["named-wrong"]
    for res in fsdp_tp:
        assert "FSDP2 reduces gradients over the dims ['dp']" in res["named-wrong"]
        assert "fully_shard(model, mesh=mesh['tp'])" in res["named-wrong"]

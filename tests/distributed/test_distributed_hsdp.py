"""HSDP (FSDP2 over a 2 x 2 (replicate, shard) mesh) and context parallelism (2 DP x 2 CP) on
4 gloo ranks, all cases in one process group: every rank after every step against a float64
full-batch reference, and the collectives of each window counted by group."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import _dist_scale as cases
from _dist import run_ranks, values
from _dist_hsdp_resume import RESUME_CASES

pytestmark = [pytest.mark.timeout(300), pytest.mark.fsdp2]  # every case runs under FSDP2

# Measured rounding band: the worst relative error over every case was 3e-16 (float64).
TOL = 1e-12


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return values(run_ranks(cases.scale_cases, 4, deadline=240, pg_timeout=60))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("name", list(cases.HSDP_CASES))
def test_hsdp_exact_on_every_rank_after_every_step(results: list[dict], name: str) -> None:
    ref = cases.hsdp_reference(cases.HSDP_CASES[name].get("max_grad_norm"))
    assert [r[name]["warnings"] for r in results] == [[]] * 4  # the right form does not warn
    for rank, res in enumerate(results):
        case = res[name]
        assert len(case["params"]) == len(ref["params"]) == 3
        for step, (got, want) in enumerate(zip(case["params"], ref["params"], strict=True)):
            assert torch.equal(got, results[0][name]["params"][step]), (rank, step)
            assert _rel(got, want) < TOL, (name, rank, step, _rel(got, want))
        for stats, norm in zip(case["stats"], ref["norms"], strict=True):
            assert abs(stats.grad_norm - norm) / norm < TOL, (name, stats.grad_norm, norm)
    # Rank 3 has 7 micro-batches: it ran padding micro-batches in windows 1 and 2.
    assert [s.micro_batches for s in results[3][name]["stats"]] == ref["micro"] == [4, 4, 2]


@pytest.mark.parametrize(
    ("name", "rs_per_micro", "ar_per_micro"),
    [("micro_batch", True, True), ("hybrid", True, False), ("window", False, False)],
)
def test_hsdp_collectives_counted_per_window(
    results: list[dict], name: str, rs_per_micro: bool, ar_per_micro: bool
) -> None:
    groups = 3  # one FSDP2 parameter group per Linear (the root holds none)
    micro = cases.hsdp_reference()["micro"]  # [4, 4, 2]: K=4, then the tail window
    for res in results:
        for counts, m in zip(res[name]["counts"], micro, strict=True):
            assert counts["rs:shard"] == groups * (m if rs_per_micro else 1), (name, counts)
            assert counts["ar:replicate"] == groups * (m if ar_per_micro else 1), (name, counts)
            # fullbatch's own: one window-start all-gather and one stats all-reduce.
            assert counts["ag:world"] == 1 and counts["ar:world"] == 1, counts
            assert "rs:replicate" not in counts and "ar:shard" not in counts, counts
    first = results[0][name]["counts"][0]
    assert (first["rs:shard"], first["ar:replicate"]) == {
        "micro_batch": (12, 12),
        "hybrid": (12, 3),
        "window": (3, 3),
    }[name]


def test_hsdp_gradient_memory_held_between_micro_batches(results: list[dict]) -> None:
    full = sum(p.numel() for p in cases.make_model3().parameters()) * 8  # float64 bytes
    for res in results:
        assert res["window"]["held"] == [full]  # FSDP2 keeps the unsharded gradients
        assert res["hybrid"]["held"] == [full // 2]  # a partial shard (2 shards)
        assert res["micro_batch"]["held"] == [full // 2]  # the sharded .grad


def test_hsdp_divisor_is_what_fsdp2_applies(results: list[dict]) -> None:
    assert [r["hybrid"]["divisor"] for r in results] == [4.0] * 4  # shard x replicate
    assert [r["hybrid-divide-1"]["divisor"] for r in results] == [1.0] * 4


def test_hsdp_window_hook_sees_the_normalized_full_gradient(results: list[dict]) -> None:
    ref = cases.hsdp_reference()
    for res in results:
        hooked = res["window"]["hook"]
        assert len(hooked) == 3
        for got, want in zip(hooked, ref["grads"], strict=True):
            assert _rel(got, want) < TOL


def test_hsdp_state_mid_window_refused_where_fsdp2_holds_gradients(results: list[dict]) -> None:
    for res in results:
        assert "fsdp_sync='hybrid'" in res["hybrid"]["state_error"]
        assert "fsdp_sync='micro_batch'" in res["hybrid"]["state_error"]  # the fix
        assert "fsdp_sync='window'" in res["window"]["state_error"]
        assert "state_error" not in res["micro_batch"]  # the sharded .grad is in the state
        assert res["hybrid"]["state_at_boundary"]  # between windows a state is fine


@pytest.mark.parametrize("name", list(RESUME_CASES))
def test_hsdp_resume_equals_uninterrupted_on_every_rank(results: list[dict], name: str) -> None:
    """States saved at a window boundary ("hybrid", "window") or mid-window ("micro_batch"),
    loaded into fresh objects built from another initialization: bitwise the uninterrupted run
    on every rank, which is the float64 full batch."""
    want = cases.hsdp_reference()["params"][-1]
    stop = RESUME_CASES[name][1]
    for rank, res in enumerate(results):
        case = res["resume"][name]
        assert torch.equal(case["resumed"], case["uninterrupted"]), (name, rank)
        assert torch.equal(case["resumed"], results[0]["resume"][name]["resumed"]), (name, rank)
        assert _rel(case["resumed"], want) < TOL, (name, rank)
        # The loader position: after window 1 (rank 3 holds 3 real items there), or mid-window
        # the window's start (its micro-batches are replayed from there, as on 1-D meshes).
        real = min(len(cases.HSDP_LAYOUT[rank]) - cases.K, cases.K)
        assert case["loader_items"] == cases.K + (real if stop[1] is None else 0)
        if stop[1] is not None:  # the sharded gradients travelled in the state
            assert case["done"] == stop[1] and case["grads"], case


def test_hsdp_refusals(results: list[dict]) -> None:
    for res in results:
        hybrid = res["refusals"]["hybrid-1d"]
        assert "1-D mesh" in hybrid
        assert "fsdp_sync='window'" in hybrid and "fsdp_sync='micro_batch'" in hybrid
        assert "under FSDP2 is not supported" in res["refusals"]["accumulate_dtype"]


def test_hsdp_auto_size_after_out_of_memory_is_exact(results: list[dict]) -> None:
    from _dist_auto import reference_windows
    from _dist_cases import reference_run

    ref = reference_run(reference_windows(cases.AUTO_ROWS))
    for rank, res in enumerate(results):
        auto = res["auto"]
        assert auto["retries"][0] >= 2, auto["retries"]  # 8 -> 4 -> 2 (and 1: fail_calls)
        for step, (got, want) in enumerate(zip(auto["params"], ref, strict=True)):
            assert torch.equal(got, results[0]["auto"]["params"][step]), (rank, step)
            assert _rel(got, want) < TOL, (rank, step, _rel(got, want))
    assert results[3]["auto"]["calls"][:2] == [8, 4]  # rank 3 ran out of memory at 8, then 4


@pytest.mark.parametrize("name", ["cp-beside", "cp-inside"])
def test_context_parallel_exact_and_counted(results: list[dict], name: str) -> None:
    ref = cases.cp_reference()
    counts = [s.count for s in results[0][name]["stats"]]
    for rank, res in enumerate(results):
        case = res[name]
        for step, (got, want) in enumerate(zip(case["params"], ref, strict=True)):
            assert _rel(got, want) < TOL, (name, rank, step, _rel(got, want))
        assert [s.count for s in case["stats"]] == counts  # each token counted once, all ranks
        for window in case["counts"]:
            assert window["ddp-hook"] == 1  # one DDP bucket per window (synced micro-batch)
            assert window["ag:world"] == 1  # the window start, over DP x CP
            beside = name == "cp-beside"
            # fullbatch's stats all-reduce over DP x CP; inside, DDP's bucket is on WORLD too.
            assert window["ar:world"] == (1 if beside else 2), window
            assert window.get("ar:dp", 0) == (1 if beside else 0), window  # DDP's bucket
            # Beside DDP's DP group, fullbatch sums the CP pieces once per window.
            assert window.get("ar:cp", 0) == (1 if beside else 0), window
    full = [sum(int((m["y"] != -100).sum()) for m in w) for w in _cp_windows()]
    assert counts == full


def _cp_windows() -> list[list[dict[str, torch.Tensor]]]:
    lay = cases.CP_LAYOUT
    return [
        [
            cases.cp_micro_batch(d, i, rows[i])
            for d, rows in enumerate(lay)
            for i in range(2 * w, min(2 * w + 2, len(rows)))
        ]
        for w in range(max((len(r) + 1) // 2 for r in lay))
    ]

"""``micro_batch_size="auto"`` on 2 gloo ranks where only one rank runs out of memory.

Every rank is checked after every step: bitwise equal across ranks, and equal (float64) to a
single-process full-batch reference on the union of the data. Runs are bounded by a short
process-group timeout and a deadline, so a hang fails the test.
"""

from __future__ import annotations

import pytest
import torch

import _dist_auto as cases
from _dist import run_ranks, values
from _dist_cases import reference_run

pytestmark = pytest.mark.timeout(180)

ROWS = [[8, 8, 6], [8, 5, 7]]  # per rank: the rows of its loader items (whole windows)
BIG = 10**9


@pytest.mark.parametrize(
    ("wrapper", "options"),
    [("ddp", {}), ("fsdp", {}), ("fsdp", {"fsdp_sync": "micro_batch"})],
)
def test_only_one_rank_runs_out_of_memory(wrapper: str, options: dict) -> None:
    spec = {"wrapper": wrapper, "rows": ROWS, "fits": [BIG, 3], "options": options}
    results = values(run_ranks(cases.auto_train, 2, spec, pg_timeout=20))
    ref = reference_run(cases.reference_windows(ROWS))
    for rank, res in enumerate(results):
        # 8 -> 4 -> 2 on both ranks, once; later windows keep 2 rows per micro-batch
        assert res["retries"] == [2, 0, 0], (rank, res["retries"])
        assert res["sizes"] == [2, 2, 2]
        assert len(res["params"]) == len(ref)
        for step, (got, want) in enumerate(zip(res["params"], ref, strict=True)):
            assert torch.equal(got, results[0]["params"][step]), (rank, step)
            err = ((got - want).abs().max() / want.abs().max()).item()
            assert err < 1e-10, (rank, step, err)
    assert results[1]["calls"][:2] == [8, 4]  # rank 1 ran out of memory at 8, then 4 rows
    assert results[0]["micro"][0] == 4


@pytest.mark.parametrize(
    ("wrapper", "options"),
    [("ddp", {}), ("fsdp", {}), ("fsdp", {"fsdp_sync": "micro_batch"})],
)
def test_out_of_memory_after_some_backward_calls(wrapper: str, options: dict) -> None:
    """Rank 1's 2nd micro-batch at 2 rows fails too: gradients of the attempt are dropped."""
    spec = {
        "wrapper": wrapper,
        "rows": ROWS,
        "fits": [BIG, 3],
        "fail_calls": [(), (3,)],  # calls: 8 (OOM), 4 (OOM), 2, 2 (OOM), then 1-row runs
        "options": options,
    }
    results = values(run_ranks(cases.auto_train, 2, spec, pg_timeout=20))
    ref = reference_run(cases.reference_windows(ROWS))
    for rank, res in enumerate(results):
        assert res["retries"] == [3, 0, 0], (rank, res["retries"])
        assert res["sizes"] == [1, 1, 1]
        for step, (got, want) in enumerate(zip(res["params"], ref, strict=True)):
            assert torch.equal(got, results[0]["params"][step]), (rank, step)
            err = ((got - want).abs().max() / want.abs().max()).item()
            assert err < 1e-10, (rank, step, err)
    assert results[1]["calls"][:5] == [8, 4, 2, 2, 1]


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp"])
def test_out_of_memory_at_one_row_fails_every_rank(wrapper: str) -> None:
    spec = {"wrapper": wrapper, "rows": ROWS, "fits": [BIG, 0]}
    results = run_ranks(cases.auto_train, 2, spec, pg_timeout=20, deadline=60)
    assert not results[1].ok and results[1].error_type == "OutOfMemoryError", results[1]
    assert "1 rows do not fit" in results[1].error
    assert not results[0].ok and results[0].error_type == "RuntimeError", results[0]
    assert "rank(s) [1] ran out of memory with micro-batches of one row" in results[0].error


def test_ddp_with_broadcast_buffers_equals_the_found_size_from_the_start() -> None:
    results = values(run_ranks(cases.auto_ddp_batchnorm, 2, pg_timeout=20))
    for res in results:
        assert len(res["auto"]) == len(res["fixed"]) == 3
        for got, want, rank0 in zip(res["auto"], res["fixed"], results[0]["auto"], strict=True):
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            assert torch.equal(got[0], rank0[0])  # BatchNorm buffers are per rank


def test_auto_under_ddp_reduces_at_step_and_refuses_an_explicit_last() -> None:
    """An "auto" size needs ``ddp_sync="step"`` under DDP: the default is "step" with it,
    "last" with a fixed size, and an explicit ``ddp_sync="last"`` with "auto" is a ValueError
    naming the fix (nothing changed: parameters, optimizer state, DDP's flag)."""
    results = values(run_ranks(cases.ddp_sync_with_auto, 2, pg_timeout=20))
    for res in results:
        # "auto": the whole window runs as one micro-batch, unsynced (reduced at step())
        assert res["default"] == [False] and res["step"] == [False]
        assert res["fixed"] == [False, True]  # "last": the last micro-batch synchronizes
        sizes = ["micro_batch_size", "micro_batch_tokens"]
        assert len(res["refused"]) == 2
        for size, message in zip(sizes, res["refused"], strict=True):
            assert f"{size}='auto' under DDP needs ddp_sync='step'" in message
            assert "got ddp_sync='last'" in message and "Drop ddp_sync=" in message
        assert res["unchanged"] and res["flag"] is True

"""DDP behaviour beyond plain training: several backward calls, static graphs, conditional
compute, data-parallel subgroups, non-finite values, user errors. gloo on CPU, every rank
checked, every run bounded by a process-group timeout and a deadline."""

from __future__ import annotations

import time

import pytest
import torch

import _dist_cases as cases
from _dist import run_ranks, values

pytestmark = pytest.mark.timeout(180)


def _close(got: list[torch.Tensor], ref: list[torch.Tensor], tol: float = 1e-10) -> None:
    assert len(got) == len(ref)
    for step, (g, r) in enumerate(zip(got, ref, strict=True)):
        err = ((g - r).abs().max() / r.abs().max()).item()
        assert err < tol, f"step {step}: relative error {err:.3g}"


def _same_on_every_rank(results: list[list[torch.Tensor]]) -> None:
    for rank, res in enumerate(results[1:], start=1):
        for step, (a, b) in enumerate(zip(res, results[0], strict=True)):
            assert torch.equal(a, b), f"rank {rank} differs after step {step}"


def test_two_backwards_on_synced_micro_batch_raise_by_default() -> None:
    results = run_ranks(cases.two_backwards, 2, "last", pg_timeout=10)
    errors = [r for r in results if not r.ok]
    assert errors, "a second backward on DDP's synced micro-batch must raise"
    raised = [r for r in errors if r.error_type == "RuntimeError" and "ddp_sync='step'" in r.error]
    assert raised, [r.error for r in errors]


def test_two_backwards_exact_with_ddp_sync_step() -> None:
    results = values(run_ranks(cases.two_backwards, 2, "step"))
    _same_on_every_rank(results)
    _close(results[0], cases.two_backwards_reference())


def test_static_graph_exact() -> None:
    results = values(run_ranks(cases.static_graph, 2))
    _same_on_every_rank(results)
    spec = {"layout": [[3, 1, 4, 2, 5], [2, 6, 1]], "k": 2}
    _close(results[0], cases.reference_for(spec))


def test_conditional_compute_exact_with_find_unused_parameters() -> None:
    results = values(run_ranks(cases.conditional, 2, True))
    _same_on_every_rank(results)
    _close(results[0], cases.conditional_reference())


def test_conditional_compute_without_find_unused_names_the_flag() -> None:
    results = run_ranks(cases.conditional, 2, False, pg_timeout=10)
    errors = [r for r in results if not r.ok]
    assert errors
    assert any("find_unused_parameters=True" in r.error for r in errors), errors


def test_subgroups_inferred_from_the_wrapper() -> None:
    results = values(run_ranks(cases.subgroups, 4, "inferred"))
    for group in (0, 1):
        a, b = results[2 * group], results[2 * group + 1]
        _same_on_every_rank([a, b])
        _close(a, cases.subgroup_reference(group))


def test_subgroups_conflicting_process_group_raises() -> None:
    results = run_ranks(cases.subgroups, 4, "conflict")
    for res in results:
        assert not res.ok and res.error_type == "ValueError", res
        assert "process_group" in res.error


def test_summing_comm_hook_exact_with_declared_divisor() -> None:
    results = values(run_ranks(cases.subgroups, 4, "sum-hook"))
    for group in (0, 1):
        _close(results[2 * group], cases.subgroup_reference(group))


def test_nonfinite_on_one_rank_skips_that_window_everywhere() -> None:
    results = values(run_ranks(cases.nonfinite, 2))
    for res in results:
        skipped = [s[0] for s in res]
        assert skipped == [True, False], skipped
        assert res[0][1] is not None and "non-finite" in res[0][1]
        assert res[1][2] == 1  # one optimizer step taken, in window 1
    assert torch.equal(results[0][1][3], results[1][1][3])
    # window 1 alone equals a full-batch step from the initial parameters
    windows = cases.reference_windows([[2, 3, 2, 2], [3, 2, 1, 2]], 2)[1:]
    _close([results[0][1][3]], cases.reference_run(windows))


def test_skipping_backward_on_the_final_micro_batch_errors_not_hangs() -> None:
    start = time.monotonic()
    results = run_ranks(cases.skip_final_backward, 2, pg_timeout=10, deadline=60)
    assert time.monotonic() - start < 60
    assert all(not r.ok for r in results)
    culprit = results[1]
    assert culprit.error_type == "RuntimeError", culprit
    assert "count=0" in culprit.error
    assert results[0].error_type != "Timeout"


def test_a_rank_that_raises_surfaces_its_own_exception() -> None:
    start = time.monotonic()
    results = run_ranks(cases.raise_in_micro_batch, 2, pg_timeout=10, deadline=60)
    assert time.monotonic() - start < 60
    assert results[1].error_type == "UserError", results[1]
    assert not results[0].ok and results[0].error_type != "Timeout", results[0]
    assert results[0].exitcode not in (0, None)


def test_discard_on_every_rank_then_train() -> None:
    results = values(run_ranks(cases.discard_then_train, 2, False))
    for res in results:
        assert res[:2] == [None, 1]
    windows = cases.reference_windows([[2, 3, 2, 2], [3, 2, 1, 2]], 2)[1:]
    _close([results[0][-1]], cases.reference_run(windows))
    assert torch.equal(results[0][-1], results[1][-1])


def test_discard_on_one_rank_only_is_an_error_on_the_others() -> None:
    results = run_ranks(cases.discard_then_train, 2, True, pg_timeout=10, deadline=60)
    assert results[1].error_type == "RuntimeError", results[1]
    assert "discard" in results[1].error


def test_optimizer_parameter_outside_the_ddp_model_is_refused() -> None:
    results = run_ranks(cases.foreign_parameter, 2)
    for res in results:
        assert res.error_type == "ValueError" and "does not own" in res.error, res

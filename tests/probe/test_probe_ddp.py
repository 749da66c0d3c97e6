"""``fb.probe`` on a hand-written DDP loop, 2 gloo ranks: the all-reduced gradient is compared
with the reference summed over every rank's micro-batches and counts; every rank reports the
same verdict, and a probed run changes neither the parameters (bitwise) nor DDP's all-reduces.
"""

from __future__ import annotations

import pytest
import torch

import _dist_probe as cases
from _dist import run_ranks, values

pytestmark = pytest.mark.timeout(180)


def _rel(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    diff = sum(float((g - r).pow(2).sum()) for g, r in zip(got, ref, strict=True))
    return (diff / sum(float(r.pow(2).sum()) for r in ref)) ** 0.5


def _run(how: str, dropout: float = 0.0) -> list[dict]:
    results = values(run_ranks(cases.probe_rank, 2, how, dropout))
    for rank in results:  # the probe changed nothing: parameters bitwise, DDP's all-reduces
        plain = rank["plain"]
        for probed in (rank["probed"], rank["builtin"]):
            assert all(
                torch.equal(a, b) for a, b in zip(plain["params"], probed["params"], strict=True)
            )
            assert plain["allreduce"] == probed["allreduce"]
        assert (plain["allreduce"] > 0) == (how != "never sync")
        assert rank["replays"] == 0  # no forward replayed under the built-in objective
        # the built-in objective (each micro-batch differentiated on its own forward) judges
        # as the replayed callable does
        for a, b in zip(
            rank["probed"]["report"].windows, rank["builtin"]["report"].windows, strict=True
        ):
            assert (a.ok, a.pattern, a.count, a.ranks) == (b.ok, b.pattern, b.count, b.ranks)
            assert b.weights == pytest.approx(a.weights, rel=1e-6, abs=1e-9)
            assert b.error == pytest.approx(a.error, rel=1e-6, abs=1e-12)
    return results


def test_right_loop_passes_on_every_rank() -> None:
    results = _run("right")
    ref = cases.reference()
    for rank in results:
        report = rank["probed"]["report"]
        assert report.ok, str(report)
        first = report.windows[0]
        assert first.ranks == (3, 2) and first.micro_batches == 5
        assert first.weights == pytest.approx([1.0] * 5, rel=1e-6)
        assert _rel(rank["probed"]["applied"][0], ref) < 1e-12 and first.error < 1e-12


def test_mean_of_means_across_ranks_is_flagged_on_every_rank() -> None:
    results = _run("mean/K")
    ref = cases.reference()
    counts = [cases.counted(m) for r in sorted(cases.LAYOUT) for m in cases.data(r)[0]]
    n = sum(counts)
    sizes = [3, 3, 3, 2, 2]  # each micro-batch's rank's micro-batch count
    expected = [n / (2 * k * c) for k, c in zip(sizes, counts, strict=True)]
    for rank in results:
        first = rank["probed"]["report"].windows[0]
        assert first.pattern == "mean of per-micro-batch means", first.diagnosis
        assert first.weights == pytest.approx(expected, rel=1e-6)
        assert first.error == pytest.approx(_rel(rank["probed"]["applied"][0], ref), rel=1e-9)
        assert "of rank 1" in first.diagnosis or "of rank 0" in first.diagnosis


def test_each_rank_dividing_by_its_own_count_is_named_on_every_rank() -> None:
    """Each rank divides its loss sum by its own item count and DDP averages the ranks: the
    micro-batches of rank r weigh N / (W · N_r). Named "per-rank count" (it was "other")."""
    results = _run("per-rank count")
    ref = cases.reference()
    own = {r: [cases.counted(m) for m in cases.data(r)[0]] for r in sorted(cases.LAYOUT)}
    n = sum(sum(c) for c in own.values())
    expected = [n / (2 * sum(own[r])) for r in sorted(own) for _ in own[r]]
    assert len(set(expected)) == 2  # the ranks hold different counts
    for rank in results:
        first = rank["probed"]["report"].windows[0]
        assert not first.ok and first.pattern == "per-rank count", first.diagnosis
        assert first.weights == pytest.approx(expected, rel=1e-6)
        assert first.error == pytest.approx(_rel(rank["probed"]["applied"][0], ref), rel=1e-9)
        assert "rank 0's micro-batches weighted" in first.diagnosis


def test_ranks_that_never_sync_differ_and_fail_on_every_rank() -> None:
    results = _run("never sync")
    assert not torch.equal(results[0]["plain"]["params"][0], results[1]["plain"]["params"][0])
    for rank in results:
        report = rank["probed"]["report"]
        assert not report.ok
        assert all(w.pattern == "ranks differ" for w in report.windows), str(report)
        assert "replicas would diverge" in report.windows[0].diagnosis


def test_dropout_under_ddp_is_replayed() -> None:
    results = _run("right", dropout=0.3)
    for rank in results:
        assert rank["probed"]["report"].ok, str(rank["probed"]["report"])

"""``fb.probe`` on FSDP2 (``fully_shard`` over a 1-D mesh, 2 gloo ranks) and HSDP (a 2 x 2
(replicate, shard) mesh, 4 ranks): plain loops right and wrong and fullbatch's own FSDP2/HSDP
routes (``fb.Accumulator``, every ``fsdp_sync``), one process group per mesh.

Every case trains 3 windows plain and again under ``fb.probe(windows=2)`` (the run goes on
after the probed windows): on every rank the probed run's parameters after every step are
bitwise the plain run's, every rank reports the same verdict, and the probe's error is the one
measured here between the plain run's applied gradient (gathered whole) and a float64
full-batch reference of the same rows (tests/_probe_fsdp_cases.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import _probe_fsdp_cases as cases
from _dist import run_ranks, values

pytestmark = [pytest.mark.timeout(300), pytest.mark.fsdp2]


@pytest.fixture(scope="module")
def fsdp() -> list[dict[str, Any]]:
    return values(run_ranks(cases.fsdp_1d, 2, deadline=240, pg_timeout=60))


@pytest.fixture(scope="module")
def hsdp() -> list[dict[str, Any]]:
    return values(run_ranks(cases.hsdp_2d, 4, deadline=240, pg_timeout=60))


def _rel(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    diff = sum(float((g - r).pow(2).sum()) for g, r in zip(got, ref, strict=True))
    return (diff / sum(float(r.pow(2).sum()) for r in ref)) ** 0.5


def _reports(results: list[dict[str, Any]], name: str) -> list[Any]:
    """Each rank's report of case ``name``, after checking that the probe changed nothing and
    that every rank says the same."""
    reports = []
    for rank, res in enumerate(results):
        case = res[name]
        assert len(case["plain"]) == len(case["probed"]) == cases.WINDOWS
        for step, (a, b) in enumerate(zip(case["plain"], case["probed"], strict=True)):
            assert torch.equal(a, b), (name, rank, step)  # bitwise: the run is unchanged
        reports.append(case["report"])
    first = reports[0]
    for report in reports[1:]:
        assert [(w.ok, w.pattern, w.error) for w in report.windows] == [
            (w.ok, w.pattern, w.error) for w in first.windows
        ], name
    return reports


def _layout(world: int) -> tuple[int, ...]:
    return (cases.K,) * world


@pytest.mark.parametrize(("mesh", "world"), [("fsdp", 2), ("hsdp", 4)])
def test_right_loop_passes_on_every_rank(mesh: str, world: int, request: Any) -> None:
    results = request.getfixturevalue(mesh)
    ref = cases.reference(world)
    applied = results[0]["right"]["applied"][0]
    assert _rel(applied, ref[0]) < 1e-12  # the loop is right: the probe must say so
    for report in _reports(results, "right"):
        assert report.ok, str(report)
        assert len(report.windows) == 2 and report.problems == ()
        first = report.windows[0]
        assert first.ranks == _layout(world) and first.micro_batches == cases.K * world
        assert first.weights == pytest.approx([1.0] * cases.K * world, rel=1e-9)
        assert first.error < 1e-12


@pytest.mark.parametrize(("mesh", "world"), [("fsdp", 2), ("hsdp", 4)])
def test_mean_of_means_is_flagged_on_every_rank(mesh: str, world: int, request: Any) -> None:
    results = request.getfixturevalue(mesh)
    ref = cases.reference(world)
    micros = [m for r in range(world) for m in cases._windows(r)[0]]
    counts = [cases.counted(m) for m in micros]
    n = sum(counts)
    expected = [n / (world * cases.K * c) for c in counts]  # FSDP2 averages over the ranks
    measured = _rel(results[0]["mean/K"]["applied"][0], ref[0])
    for report in _reports(results, "mean/K"):
        assert not report.ok
        first = report.windows[0]
        assert first.pattern == "mean of per-micro-batch means", first.diagnosis
        assert first.weights == pytest.approx(expected, rel=1e-9)
        assert first.error == pytest.approx(measured, rel=1e-9)


@pytest.mark.parametrize(
    ("mesh", "name"),
    [
        ("fsdp", "route"),
        ("hsdp", "route:hybrid"),
        ("hsdp", "route:window"),
        ("hsdp", "route:micro_batch"),
    ],
)
def test_fullbatch_routes_pass_on_every_rank(mesh: str, name: str, request: Any) -> None:
    results = request.getfixturevalue(mesh)
    world = len(results)
    ref = cases.reference(world)
    assert _rel(results[0][name]["applied"][0], ref[0]) < 1e-12
    for report in _reports(results, name):
        assert report.ok, str(report)
        assert [w.engine for w in report.windows] == ["fb.Accumulator"] * 2
        assert report.windows[0].micro_batches == cases.K * world
        assert report.windows[0].error < 1e-12

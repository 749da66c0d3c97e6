"""``fb.probe`` on tensor parallelism (``parallelize_module``, DTensor parameters): TP alone
(2 gloo ranks), FSDP2 x TP (2 x 2) and HSDP x TP ((2, 1, 2)) on 4 ranks, one process group per
world size (tests/_probe_tp_cases.py).

Every case trains 3 windows under ``fb.probe(windows=2)`` (a right loop also plain: on every
rank the probed run's parameters after every step are bitwise the plain run's), every rank
reports the same verdict, and each verdict is checked against a float64 full batch written
here: the right loop's applied gradient equals it (and the probe says right), a wrong loop's
is off by the error the probe reports, with the micro-batch weights this file derives from
the item counts.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import _probe_tp_cases as cases
from _dist import run_ranks, values

pytestmark = [pytest.mark.timeout(420), pytest.mark.fsdp2]


@pytest.fixture(scope="module")
def tp() -> list[dict[str, Any]]:
    return values(run_ranks(cases.tp_alone, 2, deadline=300, pg_timeout=60))


@pytest.fixture(scope="module")
def fsdp_tp() -> list[dict[str, Any]]:
    return values(run_ranks(cases.fsdp_tp, 4, deadline=360, pg_timeout=60))


def _rel(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    diff = sum(float((g - r).pow(2).sum()) for g, r in zip(got, ref, strict=True))
    return (diff / sum(float(r.pow(2).sum()) for r in ref)) ** 0.5


def _reports(results: list[dict[str, Any]], name: str) -> list[Any]:
    """Each rank's report of case ``name``, after checking that the probe changed nothing and
    that every rank says the same."""
    reports = []
    for rank, res in enumerate(results):
        case = res[name]
        assert len(case["probed"]) == cases.WINDOWS
        if name.endswith("right"):
            assert len(case["plain"]) == cases.WINDOWS
            for step, (a, b) in enumerate(zip(case["plain"], case["probed"], strict=True)):
                assert torch.equal(a, b), (name, rank, step)  # bitwise: the run is unchanged
        reports.append(case["report"])
    first = reports[0]
    for report in reports[1:]:
        assert [(w.ok, w.pattern, w.error) for w in report.windows] == [
            (w.ok, w.pattern, w.error) for w in first.windows
        ], name
    return reports


def _counts(data_ranks: int) -> list[int]:
    """The first window's item count per micro-batch, data rank by data rank."""
    return [cases.counted(m) for r in range(data_ranks) for m in cases.windows_of(r)[0]]


def _weights(how: str, data_ranks: int, tp: int) -> list[float]:
    """Each micro-batch's weight in the applied gradient over its right weight, from counts."""
    counts = _counts(data_ranks)
    n = sum(counts)
    if how == "mean/K":  # each micro-batch's mean over K: weight n / (K * count)
        return [n / (cases.K * c) for c in counts]
    if how == "rank count":  # the rank's own count: weight n / (its rank's count)
        per_rank = [sum(counts[r * cases.K : (r + 1) * cases.K]) for r in range(data_ranks)]
        return [n / per_rank[i // cases.K] for i in range(len(counts))]
    if how == "count over tp":  # every copy counted: n * tp
        return [1.0 / tp] * len(counts)
    return [1.0] * len(counts)


CASES = [
    ("tp", 1, 2, "right"),
    ("tp", 1, 2, "mean/K"),
    ("tp", 1, 2, "count over tp"),
    ("fsdp_tp", 2, 2, "right"),
    ("fsdp_tp", 2, 2, "mean/K"),
    ("fsdp_tp", 2, 2, "rank count"),
    ("fsdp_tp", 2, 2, "count over tp"),
    ("fsdp_tp", 2, 2, "hsdp right"),
]
PATTERNS = {
    "mean/K": "mean of per-micro-batch means",
    "rank count": "per-rank count",
    "count over tp": "not normalized",
}


@pytest.mark.parametrize(("mesh", "data_ranks", "tp_size", "how"), CASES)
def test_probe_judges_tensor_parallel_loops(
    mesh: str, data_ranks: int, tp_size: int, how: str, request: Any
) -> None:
    results = request.getfixturevalue(mesh)
    ref = cases.reference(data_ranks)[0]  # float64, the full batch of every data rank
    measured = _rel(results[0][how]["applied"][0], ref)
    weights = _weights(how, data_ranks, tp_size)
    right = how.endswith("right")
    if right:
        assert measured < 1e-12  # the loop is right: the probe must say so
    else:
        assert measured > 0.1  # the loop is wrong against the full batch written here
    for report in _reports(results, how):
        first = report.windows[0]
        assert report.ok is right, str(report)
        assert len(report.windows) == 2 and report.problems == ()
        # counts over the data ranks only: tensor-parallel copies are one micro-batch each
        assert first.ranks == (cases.K,) * data_ranks
        assert first.micro_batches == cases.K * data_ranks
        assert first.count == sum(_counts(data_ranks))
        assert first.weights == pytest.approx(weights, rel=1e-9)
        if right:
            assert first.error < 1e-12
        else:
            assert first.pattern == PATTERNS[how], first.diagnosis
            assert first.error == pytest.approx(measured, rel=1e-9)


def test_tp_beside_unnamed_data_ranks_is_refused_and_ranks_names_them(
    fsdp_tp: list[dict[str, Any]],
) -> None:
    """TP on 2 of 4 ranks, the data dim summed by hand: without ``ranks=`` the probe cannot
    tell which ranks hold other data and refuses by name; with the data group it judges the
    window over those ranks, right against the float64 full batch."""
    ref = cases.reference(2)[0]
    for res in fsdp_tp:
        refused = res["beside"]["report"]
        assert not refused.ok and refused.windows == ()
        assert any("ranks=" in p and "tensor-parallel" in p for p in refused.problems)
        named = res["ranks= right"]
        assert _rel(named["applied"][0], ref) < 1e-12
        report = named["report"]
        assert report.ok, str(report)
        first = report.windows[0]
        assert first.ranks == (cases.K, cases.K) and first.count == sum(_counts(2))
        assert first.weights == pytest.approx([1.0] * 2 * cases.K, rel=1e-9)

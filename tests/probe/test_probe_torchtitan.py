"""``fb.probe`` on torchtitan 0.3.0's own llama3 model and ``parallelize_llama`` (FSDP 2 x TP 2,
4 gloo ranks on CPU), trained by a loop that normalizes the way torchtitan's ``train_step``
does (tests/_torchtitan_cases.py says exactly which torchtitan pieces run and what is adapted
for CPU). Skipped where torchtitan is not installed (CI does not install it: its install takes
minutes; ``pip install torchtitan==0.3.0`` and ``pip install --no-deps triton`` to run it).

Each verdict is checked against a float64 full batch of the same model, unparallelized: the
right loop's applied gradient is the full batch's (float32 rounding) and the probe says right;
the count summed over the TP ranks too is half of it, and the probe says so; fb.Accumulator
on the same model gives the full batch's step on every rank.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

from _dist import run_ranks, values

_MISSING = any(importlib.util.find_spec(name) is None for name in ("torchtitan", "triton"))
pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.fsdp2,
    pytest.mark.skipif(
        _MISSING,
        reason="needs torchtitan: pip install torchtitan==0.3.0; pip install --no-deps triton",
    ),
]


@pytest.fixture(scope="module")
def cases() -> Any:
    import _torchtitan_cases

    return _torchtitan_cases


@pytest.fixture(scope="module")
def runs(cases: Any) -> list[dict[str, Any]]:
    return values(run_ranks(cases.fsdp_tp, 4, deadline=480, pg_timeout=120))


@pytest.fixture(scope="module")
def reference(cases: Any) -> dict[str, torch.Tensor]:
    return cases.reference()


def _rel(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    assert set(got) == set(ref)
    diff = sum(float((got[n].double() - ref[n]).pow(2).sum()) for n in ref)
    return (diff / sum(float(r.pow(2).sum()) for r in ref.values())) ** 0.5


def test_torchtitan_normalization_is_right(
    cases: Any, runs: list[dict[str, Any]], reference: dict[str, torch.Tensor]
) -> None:
    assert _rel(runs[0]["right"]["applied"], reference) < 1e-5  # float32 against float64
    count = sum(int((m["labels"] != -100).sum()) for r in (0, 1) for m in cases.micro_batches(r))
    for res in runs:
        report = res["right"]["report"]
        assert report.ok, str(report)
        first = report.windows[0]
        assert first.ranks == (cases.K, cases.K)  # the data ranks only: TP copies are one
        assert first.count == count
        assert first.weights == pytest.approx([1.0] * 2 * cases.K, abs=1e-5)


def test_count_over_the_tp_dim_is_named(
    cases: Any, runs: list[dict[str, Any]], reference: dict[str, torch.Tensor]
) -> None:
    measured = _rel(runs[0]["count over tp"]["applied"], reference)
    assert measured == pytest.approx(0.5, abs=1e-5)  # every gradient halved
    for res in runs:
        report = res["count over tp"]["report"]
        assert not report.ok
        first = report.windows[0]
        assert first.pattern == "not normalized", first.diagnosis
        assert first.error == pytest.approx(measured, abs=1e-5)
        assert first.weights == pytest.approx([0.5] * 2 * cases.K, abs=1e-5)


def test_accumulator_on_torchtitan_is_the_full_batch(
    cases: Any, runs: list[dict[str, Any]], reference: dict[str, torch.Tensor]
) -> None:
    """``fb.Accumulator`` on torchtitan's FSDP2 x TP model, nothing said about the mesh: the
    full batch's step on every rank, the items counted over the data ranks only."""
    count = sum(int((m["labels"] != -100).sum()) for r in (0, 1) for m in cases.micro_batches(r))
    for res in runs:
        assert _rel(res["accumulator"]["applied"], reference) < 1e-5  # float32 vs float64
        assert res["accumulator"]["count"] == count  # not once per TP rank

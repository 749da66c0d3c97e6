"""``fb.probe`` on ColossalAI-shaped objects (``TorchDDPPlugin``'s ``TorchDDPModel`` around DDP,
``OptimizerWrapper``), 2 gloo ranks, without ColossalAI (it pins an old torch; the real one runs
in ``benchmarks/seed_frameworks.py --probe``).

The probe looks through the wrapper around DDP to the model inside: a probed run changes
neither the parameters (bitwise, over the probed window and the one after it) nor DDP's bucket
all-reduces (before, its own forwards ran DDP's and added one). Two backward passes per
micro-batch (ColossalAI #5601) leave the last micro-batch's second one unreduced: every rank
says "ranks differ", with the error the test measures against the plain full batch.
"""

from __future__ import annotations

import pytest
import torch

import _dist_probe_colossal as cases
from _dist import run_ranks, values

pytestmark = pytest.mark.timeout(180)


def _rel(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    diff = sum(float((g - r).pow(2).sum()) for g, r in zip(got, ref, strict=True))
    return (diff / sum(float(r.pow(2).sum()) for r in ref)) ** 0.5


def _run(how: str, probe_model: str, find_unused: bool = False) -> list[dict]:
    results = values(run_ranks(cases.colossal_rank, 2, how, probe_model, find_unused))
    for rank in results:  # the probe changed nothing: parameters bitwise, DDP's all-reduces
        plain, probed = rank["plain"], rank["probed"]
        assert all(
            torch.equal(a, b) for a, b in zip(plain["params"], probed["params"], strict=True)
        )
        assert plain["buckets"] == probed["buckets"] == 2  # one per window: the last micro-batch
    return results


@pytest.mark.parametrize("probe_model", ["global", "given"])
def test_right_window_passes_on_every_rank(probe_model: str) -> None:
    results = _run("right", probe_model)
    ref = cases.reference()
    for rank in results:
        report = rank["probed"]["report"]
        assert report.ok, str(report)
        check = report.windows[0]  # the first of the windows checked
        assert check.ranks == (3, 2) and check.micro_batches == 5
        assert check.weights == pytest.approx([1.0] * 5, rel=1e-6)
        assert check.error < 1e-12 and _rel(rank["probed"]["applied"][0], ref) < 1e-12


def test_two_backward_passes_diverge_and_every_rank_says_so() -> None:
    results = _run("two backward", "global", find_unused=True)
    ref = cases.reference()
    first = [rank["plain"]["applied"][0] for rank in results]
    assert not all(torch.equal(a, b) for a, b in zip(*first, strict=True))  # replicas diverge
    for rank in results:
        report = rank["probed"]["report"]
        assert not report.ok
        check = report.windows[0]  # the first of the windows checked
        assert check.pattern == "ranks differ", check.diagnosis
        assert "replicas would diverge" in check.diagnosis
        measured = _rel(rank["probed"]["applied"][0], ref)
        assert 1e-4 < measured < 0.1  # only the last micro-batch's second term is off
        assert check.error == pytest.approx(measured, rel=1e-6)  # this rank's own gradient
        assert check.error > 1e3 * check.tolerance

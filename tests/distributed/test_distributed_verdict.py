"""One verdict in ``fb.Pipeline`` (PP = 2 on 2 gloo ranks): the same non-finite window as in
tests/integrations/test_wings_verdict.py — a NaN loss, or an inf gradient on one stage only — is
skipped on both stages with the same warning, leaves parameters, optimizer and scheduler state
bitwise as they were, counts ``steps == 2``, and the window after it trains exactly (float64
full batch over windows 0 and 2, written in tests/_dist_verdict.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import _dist_verdict as cases
from _dist import run_ranks, values
from fullbatch._base._versions import PIPELINE_TORCH, torch_version

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        torch_version() < PIPELINE_TORCH,
        reason=f"fullbatch.Pipeline needs torch >= 2.7 (scale_grads), found {torch.__version__}",
    ),
]

REASONS = {"nan_loss": "non-finite loss", "inf_grad": "non-finite gradient"}
TOL = 1e-12


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return values(run_ranks(cases.verdict_cases, 2, deadline=240, pg_timeout=60))


@pytest.mark.parametrize("mode", list(REASONS))
def test_pipeline_skips_the_non_finite_window_on_every_stage(
    results: list[dict[str, Any]], mode: str
) -> None:
    ref = cases.reference()
    initial = [p.detach().clone() for b in cases.make_blocks() for p in b.parameters()]
    for rank, res in enumerate(results):
        case = res[mode]
        assert case["reasons"] == [None, REASONS[mode], None], (rank, case["reasons"])
        assert (case["steps"], case["skipped"]) == (2, 1), rank
        assert case["stats_counters"] == (2, 1), rank
        case["snaps"][1].assert_equal(case["snaps"][0])  # params, optimizer, scheduler: bitwise
        (message, category, filename) = case["warnings"][0]
        assert len(case["warnings"]) == 1 and category == "RuntimeWarning"
        assert message.startswith(
            f"window 1 was skipped ({REASONS[mode]}): parameters, optimizer and scheduler are "
            "unchanged. 1 window(s) skipped so far, 1 stepped; every skip is counted in "
        ), message
        assert filename.endswith("_dist_verdict.py"), filename  # the user's line
    for step, snap in ((0, 0), (1, 2)):  # the window after the skip trains exactly
        got = [p for res in results for p in res[mode]["snaps"][snap].params]
        error = sum(float((g - w).pow(2).sum()) for g, w in zip(got, ref[step], strict=True))
        moved = sum(float((w - p).pow(2).sum()) for w, p in zip(ref[step], initial, strict=True))
        assert (error / moved) ** 0.5 < TOL, (step, (error / moved) ** 0.5)

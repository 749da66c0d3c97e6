"""Pipeline x FSDP2 on a ("dp", "pp") = 2 x 2 mesh of gloo ranks, one process group: every
rank's stage after every step against the whole model trained on the full batch (float64,
clipped, uneven labelled counts over "dp"), and dp_group= beside FSDP2 refused."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import _dist_pipe_fsdp as cases
from _dist import run_ranks, values
from fullbatch._base._versions import PIPELINE_TORCH, torch_version

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.fsdp2,
    pytest.mark.skipif(
        torch_version() < PIPELINE_TORCH,
        reason=f"fullbatch.Pipeline needs torch >= 2.7 (scale_grads), found {torch.__version__}",
    ),
]

TOL = 1e-12  # measured: worst 1.6e-16 relative


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return values(run_ranks(cases.pipe_fsdp_cases, 4, deadline=240, pg_timeout=60))


@pytest.mark.parametrize("kind", cases.SCHEDULES)
def test_pipeline_x_fsdp2_is_the_full_batch_on_every_rank(results: list[dict], kind: str) -> None:
    ref = cases.reference()
    assert min(ref["norms"]) > cases.CLIP  # the clip bites
    for rank, res in enumerate(results):
        s = rank % 2
        for step in range(cases.WINDOWS):
            got = res[kind]["params"][step]
            assert torch.equal(got, results[s][kind]["params"][step])  # both "dp" ranks
            want = torch.cat(ref["params"][step][2 * s : 2 * s + 2])
            rel = ((got - want).abs().max() / want.abs().max()).item()
            assert rel < TOL, (kind, rank, step, rel)
        stats = res[kind]["stats"]
        assert [st.count for st in stats] == ref["counts"]  # counted on the last stages, once
        for st, norm in zip(stats, ref["norms"], strict=True):
            assert abs(st.grad_norm - norm) / norm < TOL, (kind, rank, st.grad_norm, norm)


def test_dp_group_beside_fsdp2_stages_is_refused(results: list[dict]) -> None:
    for res in results:
        assert "dp_group= was given for fully_shard'ed pipeline stages" in res["dp_group"]
        assert "Drop dp_group=" in res["dp_group"]

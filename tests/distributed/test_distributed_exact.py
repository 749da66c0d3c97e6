"""DDP and FSDP2 on 2 and 3 gloo ranks: after every step, every rank's parameters are bitwise
equal and equal a single-process float64 full-batch reference on the union of the data."""

from __future__ import annotations

import pytest
import torch

import _dist_cases as cases
from _dist import run_ranks, values
from _dist_cases import reference_for, train

pytestmark = pytest.mark.timeout(180)

# Per rank: the row counts of its micro-batches, in loader order.
LAYOUTS = {
    "uneven-2": [[3, 1, 4, 2, 5], [2, 6, 1]],  # rank 1 runs out: empty last windows
    "uneven-3": [[1, 2, 3, 4], [4, 1], [2, 2, 2, 2, 2, 1, 3]],
    "no-data-rank": [[2, 3, 1, 4], []],  # rank 1 has nothing from the start
}

CASES = [
    ("ddp", "uneven-2", 2, {}),
    ("ddp", "uneven-3", 2, {}),
    ("ddp", "uneven-3", 3, {"max_grad_norm": 0.3}),
    ("ddp", "uneven-2", 2, {"ddp_sync": "step"}),
    ("ddp", "uneven-2", 2, {"partial_window": "drop"}),
    ("ddp", "uneven-3", 2, {"partial_window": "drop"}),
    ("ddp", "no-data-rank", 2, {"ddp_sync": "step"}),  # no padding needed: reduced at step()
    ("ddp", "uneven-2", 2, {"unsized": True}),
    ("fsdp", "uneven-2", 2, {}),
    ("fsdp", "uneven-3", 2, {"fsdp_sync": "micro_batch"}),
    ("fsdp", "uneven-3", 3, {"fsdp_sync": "window"}),
    ("fsdp", "uneven-2", 2, {"partial_window": "drop"}),
]


def _check(results: list[dict], reference: list[torch.Tensor]) -> None:
    first = results[0]["params"]
    assert len(first) == len(reference), (len(first), len(reference))
    for rank, res in enumerate(results):
        assert len(res["params"]) == len(first)
        for step, (mine, ref) in enumerate(zip(res["params"], first, strict=True)):
            assert torch.equal(mine, ref), f"rank {rank} differs from rank 0 after step {step}"
    for step, (got, ref) in enumerate(zip(first, reference, strict=True)):
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-10, f"step {step}: relative error {err:.3g} against the full batch"


@pytest.mark.parametrize(("wrapper", "layout", "k", "options"), CASES)
def test_exact_every_step(wrapper: str, layout: str, k: int, options: dict) -> None:
    options = dict(options)
    unsized = options.pop("unsized", False)
    spec = {"wrapper": wrapper, "layout": LAYOUTS[layout], "k": k, "options": options}
    spec["unsized"] = unsized
    results = values(run_ranks(train, len(spec["layout"]), spec))
    _check(results, reference_for(spec))
    counts = [s.count for s in results[0]["stats"]]
    for res in results[1:]:
        assert [s.count for s in res["stats"]] == counts  # stats identical on every rank


@pytest.mark.parametrize(
    ("wrapper", "options"), [("ddp", {}), ("fsdp", {}), ("fsdp", {"fsdp_sync": "micro_batch"})]
)
def test_rank_without_data_pads(wrapper: str, options: dict) -> None:
    spec = {
        "wrapper": wrapper,
        "layout": LAYOUTS["no-data-rank"],
        "k": 2,
        "padding": True,
        "options": options,
    }
    results = values(run_ranks(train, 2, spec))
    _check(results, reference_for(spec))
    assert all(p >= 1 for p in results[1]["paddings"])  # rank 1 ran padding micro-batches
    assert results[0]["paddings"] == [0] * len(results[0]["paddings"])


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp"])
def test_rank_without_data_and_no_padding_raises_everywhere(wrapper: str) -> None:
    spec = {"wrapper": wrapper, "layout": LAYOUTS["no-data-rank"], "k": 2}
    results = run_ranks(train, 2, spec)
    for res in results:
        assert not res.ok and res.error_type == "ValueError", res
        assert "padding_micro_batch" in res.error


def test_fsdp2_split_windows_pad_one_micro_batch_not_the_whole_batch() -> None:
    results = values(run_ranks(cases.split_padding, 2))
    assert results[0]["seen"] == [(False, 2)] * 4
    assert results[1]["seen"] == [(False, 2), (False, 2), (False, 1), (True, 1)]
    window = [cases.micro_batch(0, 0, 8), cases.micro_batch(1, 0, 5)]
    ref = cases.reference_run([window])[0]
    for res in results:
        err = ((res["params"] - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-10, err

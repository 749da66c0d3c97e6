"""Length-aware micro-batches on 2 gloo ranks: each rank packs its own rows, ranks get
different micro-batch counts, and every rank's parameters after every step equal the float64
full-batch reference (``pad_to_multiple_of`` too)."""

from __future__ import annotations

import pytest

import _pack_cases as cases
from _dist import run_ranks, values

WINDOWS = 3
OPTIONS = [
    {"micro_batch_tokens": 30},
    {"micro_batch_tokens": 1},  # every row a micro-batch of its own
    {"micro_batch_size": 3, "sort_rows": True},
    # widths rounded to 12: past the window's 16 columns for rows of 13 or 14 tokens
    {"micro_batch_tokens": 30, "pad_to_multiple_of": 12},
]


@pytest.mark.filterwarnings("ignore:a row of")
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp"])
@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_every_rank_every_step_equals_full_batch(wrapper: str, options: dict) -> None:
    results = values(run_ranks(cases.train, 2, wrapper, options, WINDOWS))
    ref = cases.reference(WINDOWS)
    for res in results:
        assert len(res["params"]) == WINDOWS
        for got, want in zip(res["params"], ref, strict=True):
            err = float((got - want).abs().max() / want.abs().max())
            assert err < 1e-10, err
    counts = [res["real"] for res in results]
    assert counts[0] != counts[1]  # the ranks really packed different numbers of micro-batches
    if wrapper == "fsdp":  # FSDP2: the rank with fewer micro-batches pads up to the other
        totals = [
            [r + p for r, p in zip(res["real"], res["padding"], strict=True)] for res in results
        ]
        assert totals[0] == totals[1]
        assert any(any(res["padding"]) for res in results)
    else:
        assert all(not any(res["padding"]) for res in results)


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp"])
def test_packed_every_rank_every_step_equals_full_batch(wrapper: str) -> None:
    """pack=True: the plain loop, window.run with the packing check, and without it."""
    results = values(run_ranks(cases.train_packed, 2, wrapper, WINDOWS, deadline=240))
    ref = cases.reference(WINDOWS)
    for res in results:
        for mode in ("loop", "run", "unchecked"):
            assert len(res[mode]["params"]) == WINDOWS
            for got, want in zip(res[mode]["params"], ref, strict=True):
                err = float((got - want).abs().max() / want.abs().max())
                assert err < 1e-10, (mode, err)
        # the check issues no collective (ranks check different rows): same count without it
        assert res["run"]["collectives"] == res["unchecked"]["collectives"] > 0
        assert res["unchecked"]["warnings"] == []
        if wrapper == "ddp":  # the plain loop's check passed silently too (no collective)
            assert res["run"]["report"] is True and res["run"]["warnings"] == []
            assert res["loop"]["warnings"] == []
        else:  # FSDP2: no check on sharded parameters, said once, in the loop and in run
            assert res["run"]["report"] is None
            said = ["pack=True under FSDP2: fullbatch cannot check packing on sha"]
            assert res["run"]["warnings"] == res["loop"]["warnings"] == said
    counts = [res["loop"]["real"] for res in results]
    assert counts[0] != counts[1]  # the ranks really packed different numbers of micro-batches
    if wrapper == "fsdp":
        totals = [[r + p for r, p in zip(res["loop"]["real"], res["loop"]["padding"],
                                         strict=True)] for res in results]  # fmt: skip
        assert totals[0] == totals[1] and any(any(res["loop"]["padding"]) for res in results)

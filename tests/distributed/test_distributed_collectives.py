"""Collectives counted, not inferred: one gradient reduction per bucket (DDP) or FSDP group
per window, and at most two tiny collectives per window."""

from __future__ import annotations

import pytest

import _dist_cases as cases
from _dist import run_ranks, values

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp"])
def test_one_gradient_reduction_per_window(wrapper: str) -> None:
    ours = values(run_ranks(cases.count_collectives, 2, wrapper, "fullbatch"))
    naive = values(run_ranks(cases.count_collectives, 2, wrapper, "naive"))
    for mine, theirs in zip(ours, naive, strict=True):
        buckets = mine["per_backward"]
        assert buckets >= 2, mine  # several DDP buckets / FSDP groups
        assert mine["windows"] == 3
        assert mine["grad"] == buckets * mine["windows"], mine
        assert theirs["grad"] == buckets * mine["k"] * theirs["windows"], theirs
        # One all-gather at each window's start, one all-reduce at its step (+1: the
        # end-of-data check); the lower bound keeps the count from passing at zero.
        assert 2 * mine["windows"] <= mine["tiny"] <= 2 * mine["windows"] + 1, mine


def test_fsdp_micro_batch_mode_reduces_every_micro_batch() -> None:
    res = values(run_ranks(cases.count_collectives, 2, "fsdp", "micro_batch"))
    for r in res:
        assert r["grad"] == r["per_backward"] * r["k"] * r["windows"], r

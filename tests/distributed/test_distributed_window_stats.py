"""Window statistics over 2 gloo ranks (DDP; FSDP2 for one family) with uneven micro-batches:
the MoE load-balancing loss and an M2PO-style selection are taken over every rank's
micro-batches once, and the step equals the full batch's (float64)."""

from __future__ import annotations

import copy

import pytest
import torch

import _dist_moe as cases
from _dist import run_ranks, values
from _moe_cases import FAMILIES, make_moe, reference, rel_err
from _selection_cases import importance, threshold

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(240)


def test_moe_load_balancing_exact_over_ranks() -> None:
    results = values(run_ranks(cases.moe_rank, 2, FAMILIES[:1], pg_timeout=60, deadline=200))
    for family in (FAMILIES[0], f"{FAMILIES[0]}/fsdp2"):  # all three: test_window_stats.py
        grads, loss = reference(make_moe(family.split("/")[0]), cases.moe_window())
        for rank, by_family in enumerate(results):
            res = by_family[family]
            mine = cases.MOE_SPLIT[rank]  # one pre-pass forward per micro-batch, and under
            most = max(len(m) for m in cases.MOE_SPLIT.values())  # FSDP2 padding ones
            assert res["calls"][: len(mine)] == mine, family
            assert len(res["calls"]) == (most if "fsdp2" in family else len(mine)), family
            assert rel_err(res["update"], grads) < 1e-12, family
            assert abs(res["loss"] - loss) < 1e-12 * loss
        ranks = [r[family]["counts"] for r in results]
        assert torch.equal(ranks[0]["experts"], ranks[1]["experts"])
        assert ranks[0]["rows"].item() == 2 * sum(cases.MOE_LENGTHS)  # 2 layers, every rank's


def test_selection_is_chosen_over_ranks() -> None:
    from _selection_cases import reference as selection_reference
    from conftest import make_lm

    results = values(run_ranks(cases.selection_rank, 2, pg_timeout=60, deadline=200))
    batch = cases.selection_window()
    model = make_lm()
    grads, kept = selection_reference(copy.deepcopy(model), batch)
    limit = float(threshold(importance(model, batch)))
    for res in results:
        assert res["limit"] == limit and res["count"] == kept
        assert res["n"] == int((batch["targets"] != -100).sum())
        assert rel_err(res["update"], grads) < 1e-12

"""``fb.verify(..., counts=...)`` checks a loss in the share form (issue 18)."""

from __future__ import annotations

import pytest
import torch

import fullbatch as fb
from conftest import lm_batch, make_lm

COUNTS = {"tokens": lambda m: fb.count_tokens(m["labels"])}


def _sum(model, micro):
    return fb.causal_lm_loss(model(micro["input_ids"]), micro["labels"])


def divided(model, micro, totals):
    return _sum(model, micro)[0] / totals["tokens"]


def undivided(model, micro, totals):  # the mistake: the summed loss as the share
    return _sum(model, micro)[0]


def own_count(model, micro, totals):  # the other mistake: a per-micro-batch mean
    loss_sum, n = _sum(model, micro)
    return loss_sum / n


@pytest.fixture
def batch():
    return lm_batch((7, 3, 5, 2, 6, 4), seed=1)


def test_share_divided_by_the_totals_passes(batch) -> None:
    report = fb.verify(make_lm(), batch, divided, micro_batch_size=2, counts=COUNTS)
    assert report.passed, str(report)
    assert report.fullbatch.max_rel_error < 1e-13
    assert report.naive.max_rel_error > 1e-3  # uneven counts: the naive recipe is off
    assert any("share form" in note for note in report.notes)
    assert not any("fullbatch warned" in note for note in report.notes)


@pytest.mark.parametrize("loss_fn", [undivided, own_count])
def test_share_not_divided_by_the_totals_fails_with_the_fix(batch, loss_fn) -> None:
    report = fb.verify(make_lm(), batch, loss_fn, micro_batch_size=2, counts=COUNTS)
    assert not report.passed
    assert any("does not scale as 1 / window.totals" in d for d in report.diagnosis)
    assert any("loss_sum / totals['tokens']" in d for d in report.diagnosis)


def test_share_form_needs_a_share_and_a_dict_of_counts(batch) -> None:
    with pytest.raises(TypeError, match="counts must be a non-empty dict"):
        fb.verify(make_lm(), batch, divided, micro_batch_size=2, counts={"n": 3})
    with pytest.raises(TypeError, match="must return the 0-dim share"):
        fb.verify(make_lm(), batch, lambda m, b, t: _sum(m, b), micro_batch_size=2, counts=COUNTS)


def test_share_form_leaves_the_model_unchanged(batch) -> None:
    model = make_lm()
    before = [p.detach().clone() for p in model.parameters()]
    fb.verify(model, batch, divided, micro_batch_size=2, counts=COUNTS)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())

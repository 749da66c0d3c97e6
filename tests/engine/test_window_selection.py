"""A second window statistic: an M2PO-style token selection chosen once per window with
``window.stats(..., reduce="cat")`` is split-invariant (the selection and the gradient do not
change with the micro-batch split) and equals the full batch's; chosen per micro-batch, it
is not."""

from __future__ import annotations

import copy

import pytest
import torch

import fullbatch as fb
from _selection_cases import cut, importance, loss_sum, reference, threshold, train, with_old
from conftest import lm_batch, make_lm, rel_err

LENGTHS = [9, 2, 5, 1, 7, 3, 6, 4, 8, 2]


def window_batch() -> dict:
    return with_old(lm_batch(LENGTHS, seed=3, ignore_frac=0.2), seed=5)


@pytest.mark.parametrize("sizes", [[10], [1, 4, 2, 3], [6, 1, 3], [2, 2, 2, 2, 2]])
def test_selection_is_split_invariant(sizes: list[int]) -> None:
    batch = window_batch()
    model = make_lm()
    grads, kept = reference(copy.deepcopy(model), batch)
    limit_full = float(threshold(importance(model, batch)))
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    acc = fb.Accumulator(model, opt, micro_batches=len(sizes))
    stats, limit = train(model, acc, cut(batch, sizes))
    assert limit == limit_full  # the same selection, whatever the split
    assert stats.count == kept
    got = [b - p.detach() for b, p in zip(before, model.parameters(), strict=True)]
    assert rel_err(got, grads) < 1e-12


def test_a_selection_per_micro_batch_depends_on_the_split() -> None:
    """The same loss with the threshold taken from each micro-batch alone (AReaL#1730's
    failure): the selection differs, so the test above can fail."""
    batch = window_batch()
    model = make_lm()
    grads, kept = reference(copy.deepcopy(model), batch)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    acc = fb.Accumulator(model, opt, micro_batches=4)
    for window in acc.windows(cut(batch, [1, 4, 2, 3])):
        for micro in window:
            window.backward(*loss_sum(model, micro, threshold(importance(model, micro))))
        stats = window.step()
    got = [b - p.detach() for b, p in zip(before, model.parameters(), strict=True)]
    assert stats.count != kept or rel_err(got, grads) > 1e-6

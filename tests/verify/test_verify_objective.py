"""``fb.verify(..., objective=...)`` catches a count in the wrong unit (issue 26).

A count in another unit is self-consistent: fullbatch equals the full batch *of that loss*, so
verify without a declared objective passes (shown below) although every step is scaled. With
``objective=`` each count ``loss_fn`` returns is compared with the objective's count.
"""

from __future__ import annotations

import pytest
import torch

import fullbatch as fb
from conftest import lm_batch, make_lm, model_logits

BATCH = lm_batch([7, 5, 6, 4, 5, 7], ignore_frac=0.2)


def _loss(count):
    def loss_fn(model, micro):
        loss_sum, n = fb.causal_lm_loss(model_logits(model, micro), micro["labels"])
        return loss_sum, count(micro, n)

    return loss_fn


RIGHT = _loss(lambda micro, n: n)
WRONG_UNITS = {
    "rows": lambda micro, n: micro["labels"].shape[0],
    "numel": lambda micro, n: micro["labels"].numel(),
    "batch total": lambda micro, n: fb.count_tokens(BATCH["labels"]),
    "leftover / K": lambda micro, n: n / 4,  # the old loop's K (a power of two: exact)
}


def test_the_right_count_passes() -> None:
    report = fb.verify(make_lm(), BATCH, RIGHT, micro_batch_size=2, objective="causal_lm")
    assert report.passed, str(report)


@pytest.mark.parametrize("unit", sorted(WRONG_UNITS))
def test_a_count_in_another_unit_fails_with_a_declared_objective(unit: str) -> None:
    loss_fn = _loss(WRONG_UNITS[unit])
    model = make_lm()
    before = [p.detach().clone() for p in model.parameters()]
    # rows, numel and a leftover / K are additive over rows: the same loss, scaled, passes;
    # the batch total given to every micro-batch is not (verify fails it even without)
    assert fb.verify(model, BATCH, loss_fn, micro_batch_size=2).passed is (unit != "batch total")
    report = fb.verify(model, BATCH, loss_fn, micro_batch_size=2, objective="causal_lm")
    assert not report.passed
    (line,) = [d for d in report.diagnosis if "objective='causal_lm'" in d]
    assert "a count in another unit" in line and "fb.causal_lm_loss" in line
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_the_wrong_objective_is_named_with_its_count() -> None:
    report = fb.verify(make_lm(), BATCH, RIGHT, micro_batch_size=2, objective="token")
    assert not report.passed
    want = int(fb.count_tokens(BATCH["labels"], shift=False))
    got = int(fb.count_tokens(BATCH["labels"]))
    assert any(f"loss_fn counts {got} item(s) where objective='token' counts {want}" in d
               for d in report.diagnosis), report.diagnosis  # fmt: skip


def test_a_callable_objective_is_compared_by_its_count() -> None:
    right = fb.verify(make_lm(), BATCH, RIGHT, micro_batch_size=2, objective=RIGHT)
    assert right.passed, str(right)
    rows = _loss(WRONG_UNITS["rows"])
    assert not fb.verify(make_lm(), BATCH, rows, micro_batch_size=2, objective=RIGHT).passed


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"objective": "mean"}, "objective='mean' is not known"),
        ({"objective": "causal_lm", "counts": {"n": len}}, "objective= checks the counts"),
    ],
)
def test_bad_objective_arguments_raise(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fb.verify(make_lm(), BATCH, RIGHT, micro_batch_size=2, **kwargs)


def test_an_objective_without_labels_in_the_batch_raises() -> None:
    batch = {"ids": BATCH["input_ids"], "targets": BATCH["labels"]}

    def loss_fn(model, micro):
        return fb.causal_lm_loss(model(micro["ids"]), micro["targets"])

    with pytest.raises(ValueError, match="'labels'"):
        fb.verify(make_lm(), batch, loss_fn, micro_batch_size=2, objective="causal_lm")

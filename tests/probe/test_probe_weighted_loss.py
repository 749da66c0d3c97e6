"""A class-weighted cross-entropy through ``fb.Accumulator``: its count is the weights' sum over
the counted labels (``F.cross_entropy(weight=w)``'s own mean divides by it). Passed with the
rows as its count, every step is ``Σw / rows`` times too long, which the Accumulator cannot see
(a count has the user's unit); a probe that declares the objective (the weighted sum and the
weights' sum) names it, and is silent on the right form, which equals PyTorch's weighted mean
over the whole batch in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fullbatch as fb

F64 = torch.float64
WEIGHTS = torch.tensor([0.1, 0.5, 4.0, 0.2], dtype=F64)  # rare classes weigh more


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4)).to(
        F64
    )


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    labels = torch.randint(4, (12,), generator=g)
    labels[[3, 8]] = -100
    return {"x": torch.randn(12, 5, generator=g, dtype=F64), "labels": labels}


def weighted_objective(model, micro):  # type: ignore[no-untyped-def]
    """The declared objective: the weighted sum, over the weights' sum of the counted labels."""
    labels = micro["labels"]
    loss_sum = F.cross_entropy(
        model(micro["x"]), labels, weight=WEIGHTS, reduction="sum", ignore_index=-100
    )
    return loss_sum, WEIGHTS[labels[labels != -100]].sum()


def _full_batch_grad() -> list[torch.Tensor]:
    model, batch = _model(), _batch()
    F.cross_entropy(model(batch["x"]), batch["labels"], weight=WEIGHTS).backward()
    return [p.grad for p in model.parameters()]  # type: ignore[misc]


@pytest.mark.parametrize("count", ["weights' sum", "rows"])
def test_a_weighted_loss_with_the_rows_as_its_count_is_named(count: str) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    applied: list[torch.Tensor] = []
    opt.register_step_pre_hook(
        lambda *_: applied.extend(p.grad.clone() for p in model.parameters())  # type: ignore[union-attr]
    )
    with fb.probe(objective=weighted_objective, windows=1) as probe:
        with fb.Accumulator(model, opt, micro_batch_size=3) as acc:
            for window in acc.windows([_batch()]):
                for micro in window:
                    loss_sum, n = weighted_objective(model, micro)
                    window.backward(loss_sum, n if count == "weights' sum" else len(micro["x"]))
                window.step()
    ref = _full_batch_grad()
    diff = sum(float((a - r).pow(2).sum()) for a, r in zip(applied, ref, strict=True))
    error = (diff / sum(float(r.pow(2).sum()) for r in ref)) ** 0.5
    (check,) = probe.report.windows
    labels = _batch()["labels"]
    factor = float(WEIGHTS[labels[labels != -100]].sum()) / len(labels)  # Σw / rows
    if count == "weights' sum":
        assert probe.report.ok and error < 1e-15, str(probe.report)
        return
    assert error == pytest.approx(abs(factor - 1), rel=1e-9) and error > 0.1
    assert not probe.report.ok and check.pattern == "not normalized", str(probe.report)
    assert check.factor == pytest.approx(factor, rel=1e-9)
    assert check.error == pytest.approx(error, rel=1e-6)

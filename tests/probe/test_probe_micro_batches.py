"""Which forwards are micro-batches: a forward run with gradients enabled whose output reaches no
backward (a validation loss or a metric computed without ``torch.no_grad()``) is not part of
the window, wherever it runs; a loop that skips a micro-batch's backward but still counts its
items is flagged, and the report says a forward reached no backward.

The scripts are written as people write them (a top-level loop over ``(x, y)`` tuples, bf16
parameters, a validation loss every step) and checked against a plain float64 full batch.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fullbatch as fb

K = 4


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.GELU(), nn.Linear(32, 5)).to(dtype)


def _rows(sizes, dtype, seed=1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 6, generator=g).to(dtype), torch.randint(5, (n,), generator=g))
            for n in sizes]  # fmt: skip


def _full_batch64(model: nn.Module, rows) -> list[torch.Tensor]:
    """The plain reference in float64: the window's rows as one batch, mean loss, backward."""
    ref = copy.deepcopy(model).double()
    x, y = torch.cat([r[0] for r in rows]).double(), torch.cat([r[1] for r in rows])
    F.cross_entropy(ref(x), y).backward()
    return [p.grad.clone() for p in ref.parameters()]


def _rel(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    diff = sum(float((g.double() - r).pow(2).sum()) for g, r in zip(got, ref, strict=True))
    return (diff / sum(float(r.pow(2).sum()) for r in ref)) ** 0.5


def _train(where: str, dtype: torch.dtype, *, no_grad: bool = False):
    """A right loop (summed loss over the window's rows) with a validation loss computed after
    each step (``"after step"``) or between the last backward and the step (``"before
    step"``), in eval mode or not, without ``torch.no_grad()`` unless ``no_grad``."""
    model = _model(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = _rows([2, 3, 4, 1, 3, 2, 2, 4], dtype)
    val_loader = _rows([16, 8], dtype, seed=9)
    windows = [loader[i : i + K] for i in range(0, len(loader), K)]
    errors, losses = [], []

    def validate() -> None:
        model.eval()
        with torch.no_grad() if no_grad else torch.enable_grad():
            for x, y in val_loader:
                losses.append(float(F.cross_entropy(model(x), y)))  # no backward
        model.train()

    with fb.probe(objective="sample", windows=2) as probe:
        for i, (x, y) in enumerate(loader):
            rows = sum(len(t) for _, t in windows[i // K])
            logits = model(x)
            logits = logits.float() if dtype == torch.bfloat16 else logits  # loss in float32
            (F.cross_entropy(logits, y, reduction="sum") / rows).backward()
            if (i + 1) % K == 0:
                if where == "before step":
                    validate()
                got = [p.grad for p in model.parameters()]
                errors.append(_rel(got, _full_batch64(model, windows[i // K])))
                opt.step()
                opt.zero_grad()
                if where == "after step":
                    validate()
    return probe.report, errors, losses


@pytest.mark.parametrize("where", ["after step", "before step"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_validation_forward_with_gradients_is_no_micro_batch(where, dtype) -> None:
    report, errors, losses = _train(where, dtype)
    assert len(losses) == 4
    assert max(errors) < (1e-12 if dtype == torch.float64 else 0.02)  # right, measured here
    assert report.ok, str(report)
    assert [w.micro_batches for w in report.windows] == [K, K]
    assert [w.step for w in report.windows] == [1, 2]


def test_the_same_loop_under_no_grad_is_right_too() -> None:
    report, errors, _ = _train("after step", torch.float64, no_grad=True)
    assert report.ok and max(errors) < 1e-12, str(report)


def test_forwards_that_reach_no_backward_are_counted_in_the_report() -> None:
    report, _, _ = _train("before step", torch.float64)
    assert [w.no_backward for w in report.windows] == [2, 2]
    assert "2 forwards reached no backward" in str(report)


@pytest.mark.parametrize("where", ["between micro-batches", "last"])
def test_a_skipped_backward_still_counted_in_the_divisor_is_flagged(where: str) -> None:
    """A training forward whose backward is skipped is left out of the window like any forward
    that reaches no backward; a loop that still divides by its items is flagged, and the
    sentence points at the forward left out."""
    model = _model(torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    window = _rows([2, 3, 4, 1], torch.float64)
    skipped = 1 if where == "between micro-batches" else 3
    rows = sum(len(y) for _, y in window)
    with fb.probe(objective="sample") as probe:
        for i, (x, y) in enumerate(window):
            loss = F.cross_entropy(model(x), y, reduction="sum") / rows
            if i != skipped:
                loss.backward()
        kept = [r for i, r in enumerate(window) if i != skipped]
        share = sum(len(y) for _, y in kept) / rows
        ref = _full_batch64(model, kept)
        got = [p.grad for p in model.parameters()]
        assert _rel(got, [r * share for r in ref]) < 1e-12  # measured here: x share
        opt.step()
    (check,) = probe.report.windows
    assert not check.ok and check.micro_batches == 3 and check.no_backward == 1
    assert check.pattern == "not normalized" and check.factor == pytest.approx(share)
    assert "1 forward of this window reached no backward" in check.diagnosis


def test_a_logging_forward_between_micro_batches_is_no_micro_batch() -> None:
    """A second forward of each micro-batch for a metric, gradients on, no backward: right."""
    model = _model(torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    window = _rows([2, 3, 4, 1], torch.float64)
    rows = sum(len(y) for _, y in window)
    accuracy = []
    with fb.probe(objective="sample") as probe:
        for x, y in window:
            (F.cross_entropy(model(x), y, reduction="sum") / rows).backward()
            accuracy.append(float((model(x).argmax(-1) == y).float().mean()))  # no no_grad
        assert _rel([p.grad for p in model.parameters()], _full_batch64(model, window)) < 1e-12
        opt.step()
    (check,) = probe.report.windows
    assert probe.report.ok and check.micro_batches == 4 and check.no_backward == 4, check


def test_a_window_whose_forwards_reach_no_backward_has_nothing_to_check() -> None:
    model = _model(torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with fb.probe(objective="sample") as probe:
        for x, _y in _rows([2, 3], torch.float64):
            model(x)  # forward, no backward
        opt.step()
    (check,) = probe.report.windows
    assert not probe.report.ok and check.pattern == "nothing to check"
    assert "2 forwards ran with gradients but reached no backward" in check.diagnosis

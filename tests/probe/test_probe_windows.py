"""How many windows ``fb.probe`` checks: at least the first two by default (a gradient left over
by a missing ``zero_grad()`` shows only in the second), every window with ``windows="all"``;
the report says which windows it checked; anything else is a ValueError naming the value.

The loops are written as scripts write them (a top-level loop over ``(x, y)`` tuples, a step
every K micro-batches) and checked against a plain float64 full batch computed here.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fullbatch as fb

K = 4
F64 = torch.float64


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 5)).to(F64)


def _loader(sizes: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 6, generator=g, dtype=F64), torch.randint(5, (n,), generator=g))
            for n in sizes]  # fmt: skip


def _full_batch(model: nn.Module, rows: list[tuple[torch.Tensor, torch.Tensor]]) -> list:
    """The plain reference: the window's rows as one batch, PyTorch's mean loss, one backward."""
    ref = copy.deepcopy(model)
    x, y = torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])
    F.cross_entropy(ref(x), y).backward()
    return [p.grad.clone() for p in ref.parameters()]


def _rel(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    diff = sum(float((g - r).pow(2).sum()) for g, r in zip(got, ref, strict=True))
    return (diff / sum(float(r.pow(2).sum()) for r in ref)) ** 0.5


def _train(loader, *, zero_grad: bool, probe_kwargs: dict | None):
    """The script: sum of losses over the window's rows, a step every K micro-batches (and at
    the end); the test records, at each step, the gradient applied and the full batch's."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    windows = [loader[i : i + K] for i in range(0, len(loader), K)]
    rows = [sum(len(y) for _, y in w) for w in windows]
    seen: list[tuple[list, list]] = []

    def record(optimizer, args, kwargs):  # registered first: runs before the probe's check
        window = windows[len(seen)]
        seen.append(([p.grad.clone() for p in model.parameters()], _full_batch(model, window)))

    opt.register_step_pre_hook(record)
    with fb.probe(objective="sample", **(probe_kwargs or {})) as probe:
        for i, (x, y) in enumerate(loader):
            loss = F.cross_entropy(model(x), y, reduction="sum") / rows[i // K]
            loss.backward()
            if (i + 1) % K == 0 or i == len(loader) - 1:
                opt.step()
                if zero_grad:
                    opt.zero_grad()
    return probe.report, seen


def test_a_missing_zero_grad_is_caught_at_the_default_windows() -> None:
    """Window 1 is right; window 2 applies its own gradient plus window 1's: the default
    checks both and names the leftover."""
    report, seen = _train(_loader([2, 3, 4, 1] * 3), zero_grad=False, probe_kwargs=None)
    (got1, ref1), (got2, ref2) = seen[:2]
    assert _rel(got1, ref1) < 1e-12  # measured here: window 1 right,
    assert _rel(got2, [r + g for r, g in zip(ref2, got1, strict=True)]) < 1e-12  # 2 keeps 1's
    assert _rel(got2, ref2) > 0.1
    first, second = report.windows
    assert first.ok and first.pattern == "right"
    assert not second.ok and second.pattern == "leftover gradient", str(report)
    assert second.leftover == pytest.approx(1.0, rel=1e-6)
    assert not report.ok
    assert "windows 1-2 checked" in str(report)


def test_the_same_loop_with_zero_grad_is_right_at_the_default_windows() -> None:
    report, seen = _train(_loader([2, 3, 4, 1] * 3), zero_grad=True, probe_kwargs=None)
    assert all(_rel(got, ref) < 1e-12 for got, ref in seen)
    assert report.ok, str(report)
    assert [w.step for w in report.windows] == [1, 2]
    assert str(report).startswith("fullbatch probe: RIGHT (windows 1-2 checked")


def test_windows_all_checks_every_window_to_the_end_of_the_block() -> None:
    """The loop divides its short tail window as if it were full: only window 3 is wrong; the
    default stops after window 2 (right), ``windows="all"`` finds it."""
    loader = _loader([2, 3, 4, 1, 3, 2, 2, 3, 3, 1])  # windows of 4, 4, 2: 10, 10, 4 rows

    def tail_as_full(probe_kwargs):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        full_rows = sum(len(y) for _, y in loader[:K])  # "the rows of a window": 10
        applied = []
        with fb.probe(objective="sample", **probe_kwargs) as probe:
            for i, (x, y) in enumerate(loader):
                (F.cross_entropy(model(x), y, reduction="mean") * len(y) / full_rows).backward()
                if (i + 1) % K == 0 or i == len(loader) - 1:
                    applied.append([p.grad.clone() for p in model.parameters()])
                    opt.step()
                    opt.zero_grad()
        return probe.report, applied

    default, _ = tail_as_full({})
    every, applied = tail_as_full({"windows": "all"})
    assert default.ok and len(default.windows) == 2, str(default)
    assert [w.step for w in every.windows] == [1, 2, 3]
    assert [w.micro_batches for w in every.windows] == [4, 4, 2]
    assert not every.ok and every.windows[2].pattern != "right", str(every)
    assert every.windows[0].ok and every.windows[1].ok
    assert "windows 1-3 checked" in str(every)
    # measured here: window 3's applied gradient is its full batch times its rows / full_rows
    tail_rows = sum(len(y) for _, y in loader[8:])
    assert every.windows[2].factor == pytest.approx(tail_rows / sum(len(y) for _, y in loader[:K]))
    assert every.windows[2].error > 0.1 and len(applied) == 3


def test_fewer_windows_than_asked_are_said() -> None:
    report, _ = _train(_loader([2, 3, 4, 1]), zero_grad=True, probe_kwargs={"windows": 3})
    assert report.ok and len(report.windows) == 1
    text = str(report)
    assert "window 1 checked" in text and "ended before window 2" in text


@pytest.mark.parametrize("windows", [0, -1, 1.5, "every", True, "2"])
def test_windows_must_be_a_positive_int_none_or_all(windows: object) -> None:
    with pytest.raises(ValueError, match="windows") as raised:
        fb.probe(objective="sample", windows=windows)  # type: ignore[arg-type]
    assert repr(windows) in str(raised.value) and "'all'" in str(raised.value)

"""``window.run(fn)``: the same machinery as the plain loop, in one call.

Each test compares ``window.run`` with the plain ``for micro in window`` loop on the same
model and data (float64): parameters and StepStats must be bitwise equal.
"""

from __future__ import annotations

import copy

import pytest
import torch

import fullbatch as fb
from conftest import class_batch, make_mlp, params


def _windows() -> list[dict]:
    return [class_batch(7, seed=i, ignore=(i,)) for i in range(3)]


def _loop(model, windows, **kwargs):
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    out = []
    with fb.Accumulator(model, opt, **kwargs) as acc:
        for window in acc.windows(windows):
            for micro in window:
                window.backward(*fb.cross_entropy_sum(model(micro["x"]), micro["y"]))
            out.append((window.step(), params(model)))
    return out


def _run(model, windows, **kwargs):
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    out = []
    with fb.Accumulator(model, opt, **kwargs) as acc:
        for window in acc.windows(windows):
            stats = window.run(lambda m: fb.cross_entropy_sum(model(m["x"]), m["y"]))
            out.append((stats, params(model)))
    return out


@pytest.mark.parametrize(
    "kwargs", [{"micro_batch_size": 2}, {"micro_batch_size": 7}, {"micro_batches": 1}]
)
def test_run_equals_the_plain_loop(kwargs) -> None:
    model = make_mlp()
    windows = _windows()
    want = _loop(copy.deepcopy(model), windows, **kwargs)
    got = _run(model, windows, **kwargs)
    assert len(got) == len(want) == 3
    for (gs, gp), (ws, wp) in zip(got, want, strict=True):
        assert gs == ws and gs.retries == 0
        assert all(torch.equal(a, b) for a, b in zip(gp, wp, strict=True))


def test_run_with_shares_and_counts() -> None:
    model = make_mlp()
    ref = copy.deepcopy(model)
    counts = {"items": lambda m: int((m["y"] != -100).sum())}
    want = _loop(ref, _windows(), micro_batch_size=3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    with fb.Accumulator(model, opt, micro_batch_size=3, counts=counts) as acc:
        for window, (ws, wp) in zip(acc.windows(_windows()), want, strict=True):
            total = window.totals["items"]

            def share(m, total=total):
                return fb.cross_entropy_sum(model(m["x"]), m["y"])[0] / total

            stats = window.run(share)
            assert stats.loss == pytest.approx(ws.loss, rel=1e-12)
            for a, b in zip(params(model), wp, strict=True):
                assert torch.allclose(a, b, rtol=1e-12, atol=1e-14)


def test_share_without_counts_raises_and_leaves_no_gradient() -> None:
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with fb.Accumulator(model, opt, micro_batch_size=3) as acc:
        for window in acc.windows(_windows()[:1]):
            with pytest.raises(ValueError, match="counts="):
                window.run(lambda m: fb.cross_entropy_sum(model(m["x"]), m["y"])[0])
            assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("bad", [None, 1.0, (1, 2, 3)])
def test_fn_returning_something_else_raises(bad) -> None:
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with fb.Accumulator(model, opt, micro_batch_size=3) as acc:
        for window in acc.windows(_windows()[:1]):
            with pytest.raises(ValueError, match=r"return \(loss_sum, count\)"):
                window.run(lambda m, bad=bad: bad)


class Boom(Exception):
    pass


def test_exception_in_fn_propagates_and_the_next_window_is_normal() -> None:
    model = make_mlp()
    ref = copy.deepcopy(model)
    windows = _windows()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    calls = []

    def fn(m):
        calls.append(m["x"].shape[0])
        loss = fb.cross_entropy_sum(model(m["x"]), m["y"])
        if len(calls) == 3:  # window 0, after two backward calls
            raise Boom("in micro-batch 3")
        return loss

    before = params(model)
    stats = []
    with fb.Accumulator(model, opt, micro_batch_size=2) as acc:
        for window in acc.windows(windows):
            if window.index == 0:
                with pytest.raises(Boom):
                    window.run(fn)
                assert all(p.grad is None for p in model.parameters())
                assert all(torch.equal(a, b) for a, b in zip(params(model), before, strict=True))
                with pytest.raises(RuntimeError, match="already stepped or discarded"):
                    window.step()
                continue
            stats.append(window.run(fn))
    assert [s.steps for s in stats] == [1, 2]
    want = _loop(ref, windows[1:], micro_batch_size=2)
    assert all(torch.equal(a, b) for a, b in zip(params(model), want[-1][1], strict=True))


def test_run_after_iterating_raises() -> None:
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with fb.Accumulator(model, opt, micro_batch_size=3) as acc:
        for window in acc.windows(_windows()[:1]):
            for micro in window:
                window.backward(*fb.cross_entropy_sum(model(micro["x"]), micro["y"]))
            window.step()
            with pytest.raises(RuntimeError, match="already stepped or discarded"):
                window.run(lambda m: fb.cross_entropy_sum(model(m["x"]), m["y"]))

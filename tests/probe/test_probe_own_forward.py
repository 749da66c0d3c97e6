"""The reference taken on the engine's own forward (``fullbatch._probe._early``): under a
built-in objective each micro-batch is differentiated on the graph its forward just built, so no
forward runs twice. Judged against the plain full batch of ``tests/_probe_cases.py``:

- every loop of ``_probe_cases.accumulate`` (right, and each mistake) gets the verdict, the
  weights and the error the replayed callable objective gets, dropout included, and no forward
  is replayed;
- where the output cannot be used (a tuple that starts with the model's own loss, the labels
  passed to it) or a call cannot be differentiated there (reentrant checkpointing), or the
  window's calls are not the ones taken, the window is replayed at ``step()``.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fullbatch as fb
from _probe_cases import (
    IGNORE,
    accumulate,
    applied,
    counted,
    full_batch_grad,
    make_net,
    micro_batches,
    objective,
    rel_error,
)
from fullbatch._probe import _early, _reference

SIZES = (1, 4, 2, 5)


@pytest.fixture
def replays(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How many calls the probe replayed at step()."""
    count = {"n": 0}
    original = _reference.replay

    def counted_replay(*args: Any, **kwargs: Any) -> Any:
        count["n"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(_reference, "replay", counted_replay)
    return count


def _probe(how: str, declared: Any, dropout: float) -> tuple[Any, float]:
    model = make_net(dropout=dropout).train()
    window = micro_batches(SIZES)
    ref = full_batch_grad(model.eval(), window) if dropout == 0 else None
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(7)  # the same dropout masks in both runs
    with fb.probe(objective=declared, windows=1) as probe:
        accumulate(model, window, how)
        got = applied(model)
        opt.step()
    return probe.report.windows[0], rel_error(got, ref) if ref is not None else float("nan")


@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize(
    "how", ["global", "mean/K", "mean", "global*K", "global/K", "drop 2", "twice 1"]
)
def test_judged_as_the_replay_judges_with_no_forward_replayed(
    how: str, dropout: float, replays: dict[str, int]
) -> None:
    replayed, _ = _probe(how, objective, dropout)
    assert replays["n"] >= len(SIZES)
    replays["n"] = 0
    own, measured = _probe(how, "sample", dropout)
    if how == "drop 2":  # a forward that reaches no backward is no micro-batch: the window's
        assert replays["n"] >= len(SIZES) - 1  # calls are not those taken, so it is replayed
    else:
        assert replays["n"] == 0
    assert (own.ok, own.pattern, own.count) == (replayed.ok, replayed.pattern, replayed.count)
    assert own.ok == (how == "global")
    assert own.weights == pytest.approx(replayed.weights, rel=1e-9, abs=1e-12)
    assert own.error == pytest.approx(replayed.error, rel=1e-9, abs=1e-14)
    if dropout == 0 and how != "drop 2":  # the plain full batch: the error the test measures
        # (a forward with no backward is no micro-batch: "drop 2"'s window is the other three)
        assert own.error == pytest.approx(measured, rel=1e-9, abs=1e-14)


class LossFirst(nn.Module):
    """A model that returns ``(loss, logits)`` when given labels (``return_dict=False``)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        logits = self.net(x)
        if labels is None:
            return (logits,)
        return F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum"), logits


def test_a_tuple_that_starts_with_the_loss_is_replayed(replays: dict[str, int]) -> None:
    model = LossFirst()
    window = micro_batches(SIZES)
    ref = full_batch_grad(model.net, window)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    total = sum(counted(m) for m in window)
    with fb.probe(objective="sample", windows=1) as probe:
        for micro in window:
            loss_sum, _ = model(micro["x"], labels=micro["labels"])
            (loss_sum / total).backward()
        got = applied(model.net)
        opt.step()
    assert probe.report.ok and rel_error(got, ref) < 1e-13, str(probe.report)
    assert replays["n"] >= len(SIZES)  # the replay runs the model without the labels


def test_a_window_whose_calls_are_not_those_taken_is_replayed(replays: dict[str, int]) -> None:
    """A forward the window leaves out (here: the last, which reaches no backward): the
    reference is exactly the window's calls', replayed."""
    model = make_net()
    window = micro_batches(SIZES)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    total = sum(counted(m) for m in window[:-1])
    with fb.probe(objective="sample", windows=1) as probe:
        for micro in window[:-1]:
            (fb.cross_entropy_sum(model(micro), micro["labels"])[0] / total).backward()
        with torch.enable_grad():
            model(window[-1])  # a forward that reaches no backward
        opt.step()
    (check,) = probe.report.windows
    assert replays["n"] >= len(SIZES) - 1
    assert check.ok and check.count == total and check.micro_batches == len(SIZES) - 1


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.net, batch["x"], use_reentrant=True)


def test_reentrant_checkpointing_is_named_not_broken() -> None:
    """``torch.autograd.grad`` cannot go through reentrant checkpointing: the early backward
    fails before it changes anything, the engine's own backward runs, and the probe names
    the fix at step() (the replay's message)."""
    model = Checkpointed()
    window = micro_batches(SIZES)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # reentrant checkpointing differentiates only outputs of inputs that require grad
    window = [{**m, "x": m["x"].clone().requires_grad_()} for m in window]
    with pytest.raises(RuntimeError, match="reentrant activation checkpointing"):
        with fb.probe(objective="sample", windows=1):
            for micro in window:
                fb.cross_entropy_sum(model(micro), micro["labels"])[0].backward()
            grads = applied(model)
            opt.step()
    plain = Checkpointed()
    for micro in window:
        fb.cross_entropy_sum(plain(micro), micro["labels"])[0].backward()
    assert all(torch.equal(a, b) for a, b in zip(grads, applied(plain), strict=True))


def test_a_windows_gradients_go_with_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """What was taken at the forwards (a gradient-sized reference) is freed by reference
    counting once its window is checked: no cycle waits for the garbage collector."""
    made: list[weakref.ref[Any]] = []

    def alive() -> int:
        return sum(r() is not None for r in made)

    class Tracked(_early.Taken):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(weakref.ref(self))

    monkeypatch.setattr(_early, "Taken", Tracked)
    model = make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gc.disable()
    try:
        with fb.probe(objective="sample", windows=2) as probe:
            for window in range(3):
                accumulate(model, micro_batches(SIZES), "global")
                assert alive() == (window < 2)  # this window's, until its step; none after
                opt.step()
                opt.zero_grad()
                assert alive() == 0
    finally:
        gc.enable()
    assert probe.report.ok and len(probe.report.windows) == 2

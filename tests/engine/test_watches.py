"""The engine's checks are one watch list, built once per Accumulator (``_engine/_watch.py``).

One-time checks run once and drop out; a new check is a class implementing ``Watch``; a watch
that refuses ends the window before anything changes; closing the Accumulator closes them.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import fullbatch as fb
import fullbatch._engine._labels as labels_module
from conftest import Snapshot, lm_batch, make_lm
from fullbatch._engine._watch import Watch, Watches

STEADY = ["LoopGuard", "SameLossTwice", "LearningRateWatch"]


def _names(acc: fb.Accumulator) -> list[str]:
    return [type(w).__name__ for w in acc._engine.watches]


def _train(acc: fb.Accumulator, model: torch.nn.Module, loader: list[Any]) -> None:
    for window in acc.windows(loader):
        for micro in window:
            window.backward(*fb.causal_lm_loss(model(micro["input_ids"]), micro["labels"]))
        window.step()


def _micro_batches(k: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    return [lm_batch([5, 3], seed=seed + i) for i in range(k)]


def test_one_time_checks_drop_out_after_the_first_window() -> None:
    model = make_lm()
    acc = fb.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batches=3)
    assert _names(acc) == [
        "LoopGuard", "SameLossTwice", "ScaledLossWatch", "LearningRateWatch", "LabelCheck",
        "LoaderChecks",
    ]  # fmt: skip
    _train(acc, model, _micro_batches(3))
    assert _names(acc) == [*STEADY, "LoaderChecks"]  # the label and scale checks ran two calls
    _train(acc, model, _micro_batches(3, seed=5))  # a second acc.windows(): window 0 again
    assert _names(acc) == STEADY  # the loader's items were looked at in one whole window
    assert acc._engine.watches.at("on_micro_batch") == ()  # nothing left per yielded item


def test_with_a_scheduler_the_learning_rate_watch_is_not_built() -> None:
    model = make_lm()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    acc = fb.Accumulator(model, opt, micro_batches=2, scheduler=sched)
    assert "LearningRateWatch" not in _names(acc)
    _train(acc, model, _micro_batches(4))
    assert _names(acc) == ["LoopGuard", "SameLossTwice"]


def test_the_label_check_reads_two_backward_calls_only(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = labels_module.label_mistake

    def counting(*args: Any, **kwargs: Any) -> str | None:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(labels_module, "label_mistake", counting)
    model = make_lm()
    acc = fb.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batches=4)
    _train(acc, model, _micro_batches(12))
    assert len(calls) == 2


class Refuse(Watch):
    """A new check in one class: refuses the second backward of every window, or the step."""

    def __init__(self, at: str) -> None:
        self.at = at
        self.closed = 0
        self.seen: list[tuple[str, int]] = []

    def on_micro_batch(self, state: Any, micro: Any) -> None:
        self.seen.append(("micro", state.yielded))

    def before_backward(self, state: Any, loss: torch.Tensor, count: Any) -> None:
        self.seen.append(("before", state.backwards))
        if self.at == "backward" and state.backwards == 1:
            raise ValueError("refused by a new check")

    def after_backward(self, state: Any) -> None:
        self.seen.append(("after", state.backwards))

    def before_step(self, state: Any) -> None:
        self.seen.append(("step", state.backwards))
        if self.at == "step":
            raise ValueError("refused by a new check")

    def close(self) -> None:
        self.closed += 1


@pytest.mark.parametrize("at", ["backward", "step"])
def test_a_new_watch_that_refuses_ends_the_window_before_anything_changes(at: str) -> None:
    model = make_lm()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    acc = fb.Accumulator(model, opt, micro_batches=3)
    refuse = Refuse(at)
    acc._engine.watches = Watches([*acc._engine.watches, refuse])
    before = Snapshot.take(model, opt)
    with pytest.raises(ValueError, match="refused by a new check"):
        _train(acc, model, _micro_batches(3))
    before.assert_same(model, opt)
    assert all(p.grad is None for p in model.parameters())
    assert acc._engine.window is None  # the window was ended (abandoned)
    if at == "backward":  # told in order, at every point, until it refused
        assert refuse.seen == [("micro", 1), ("before", 0), ("after", 0), ("micro", 2),
                               ("before", 1)]  # fmt: skip
    else:
        assert refuse.seen[-1] == ("step", 3) and len(refuse.seen) == 10
    acc.close()
    assert refuse.closed == 1
    _train(fb.Accumulator(model, opt, micro_batches=3), model, _micro_batches(3))  # usable


def test_a_watch_that_is_done_is_closed_and_dropped_from_every_point() -> None:
    class Once(Watch):
        closed = 0

        def on_micro_batch(self, state: Any, micro: Any) -> None:
            return None

        def before_backward(self, state: Any, loss: torch.Tensor, count: Any) -> bool:
            return True

        def close(self) -> None:
            self.closed += 1

    class Other(Watch):
        closed = 0

        def on_micro_batch(self, state: Any, micro: Any) -> None:
            return None

        def before_backward(self, state: Any, loss: torch.Tensor, count: Any) -> None:
            return None

        def close(self) -> None:
            self.closed += 1

    once, other = Once(), Other()
    watches = Watches([once, other])
    assert watches.at("on_micro_batch") == (once, other)
    watches.before_backward(None, torch.zeros(()), 1)  # type: ignore[arg-type]
    assert list(watches) == [other] and once.closed == 1
    assert watches.at("on_micro_batch") == (other,) and watches.at("before_backward") == (other,)
    watches.close()
    assert list(watches) == [] and other.closed == 1 and once.closed == 1

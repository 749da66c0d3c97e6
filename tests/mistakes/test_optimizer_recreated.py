"""Issue 26: the optimizer re-created after the Accumulator was built.

fullbatch steps the optimizer it was given; a new one over the same parameters (another
learning rate, a scheduler built on it) never applies (measured: the old LR stepped, 50% off
the intended update here). Refused when the new optimizer is stepped during
``acc.windows(loader)`` (inside a window or between two) and when ``scheduler=`` belongs to
another optimizer, before anything changes. A new optimizer that is never stepped cannot be
seen: ``stats.lr`` reports the learning rate really used (documented).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import fullbatch as fb
from conftest import Snapshot, fb_loss, lm_batch, make_lm, params

LENGTHS = (7, 3, 5, 2, 6, 4)


def _windows(acc, model, loader, after_backward=None, after_step=None) -> list[fb.StepStats]:
    stats = []
    for win in acc.windows(loader):
        for micro in win:
            win.backward(*fb_loss(model, micro))
            if after_backward is not None:
                after_backward()
        stats.append(win.step())
        if after_step is not None:
            after_step()
    return stats


def test_a_recreated_optimizer_that_is_never_stepped_is_silent_and_its_lr_ignored() -> None:
    """Documented, not detected: the old optimizer steps; stats.lr says which LR was used."""
    model = make_lm()
    start = params(model)
    acc = fb.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.5), micro_batch_size=2)
    fresh = torch.optim.SGD(model.parameters(), lr=1.0)  # the mistake: re-created, lr doubled
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (stats,) = _windows(acc, model, [lm_batch(LENGTHS)])
    acc.close()
    assert stats.lr == 0.5 and fresh.param_groups[0]["lr"] == 1.0
    ref = make_lm()
    fb_ref = fb.Accumulator(ref, torch.optim.SGD(ref.parameters(), lr=1.0), micro_batch_size=2)
    _windows(fb_ref, ref, [lm_batch(LENGTHS)])
    intended = [a - b for a, b in zip(start, params(ref), strict=True)]
    applied = [a - b for a, b in zip(start, params(model), strict=True)]
    for got, want in zip(applied, intended, strict=True):
        assert torch.allclose(got, want / 2, rtol=1e-12, atol=1e-15)  # half the update


@pytest.mark.parametrize("when", ["inside", "after"])
def test_stepping_the_recreated_optimizer_during_the_windows_raises(when: str) -> None:
    model = make_lm()
    old = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    acc = fb.Accumulator(model, old, micro_batch_size=2)
    new = torch.optim.AdamW(model.parameters(), lr=1.0)  # the mistake
    loader = [lm_batch(LENGTHS, seed=s) for s in range(2)]
    hooks = {"after_backward" if when == "inside" else "after_step": new.step}
    snap: list[Snapshot] = []
    if when == "after":
        hooks["after_step"] = lambda: (snap.append(Snapshot.take(model, old)), new.step())
    else:
        snap.append(Snapshot.take(model, old))
    with pytest.raises(
        RuntimeError, match=rf"AdamW\.step\(\) \(lr=1\.0\) was called {when} window 0"
    ) as e:
        _windows(acc, model, loader, **hooks)
    assert "fb.Accumulator(model, optimizer, ...)" in str(e.value)
    snap[0].assert_same(model, old)
    assert not new.state  # the re-created optimizer never stepped
    acc.close()


def test_a_scheduler_of_another_optimizer_is_refused_at_construction() -> None:
    model = make_lm()
    old = torch.optim.SGD(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(old, step_size=1)
    new = torch.optim.SGD(model.parameters(), lr=1.0)  # re-created after the scheduler
    with pytest.raises(ValueError, match=r"scheduler= changes the learning rate of another"):
        fb.Accumulator(model, new, micro_batch_size=2, scheduler=sched)


def test_other_optimizers_and_later_phases_stay_allowed() -> None:
    model, critic = make_lm(), make_lm(seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    critic_opt = torch.optim.SGD(critic.parameters(), lr=0.1)

    def train_critic() -> None:  # another model's optimizer, inside a window: fine
        critic_opt.zero_grad()
        fb_loss(critic, lm_batch(LENGTHS))[0].backward()
        critic_opt.step()

    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with fb.Accumulator(model, opt, micro_batch_size=2, scheduler=sched) as acc:
            stats = _windows(acc, model, [lm_batch(LENGTHS)] * 2, after_backward=train_critic)
            assert [s.lr for s in stats] == [0.5, 0.25]
            # a second phase with a new optimizer once the windows are done: fine
            phase2 = torch.optim.SGD(model.parameters(), lr=0.01)
            fb_loss(model, lm_batch(LENGTHS))[0].backward()
            phase2.step()

    class Wrapper(torch.optim.Optimizer):  # shares its param groups (Lookahead-style)
        def __init__(self, inner: torch.optim.Optimizer) -> None:
            self.inner = inner
            self.param_groups = inner.param_groups
            self.defaults = inner.defaults
            self.state = inner.state

        def step(self, closure=None):  # type: ignore[no-untyped-def]
            return self.inner.step(closure)

    inner = torch.optim.SGD(model.parameters(), lr=0.5)
    wrapped = torch.optim.lr_scheduler.StepLR(Wrapper(inner), step_size=1)
    fb.Accumulator(model, inner, micro_batch_size=2, scheduler=wrapped).close()

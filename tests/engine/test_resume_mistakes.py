"""Resume mistakes a new user makes, each refused before anything changes.

Every refusal is followed by the correct resume on the same objects, which must still be
bitwise the uninterrupted run: the refused attempt changed nothing (parameters, optimizer
state, scheduler, the Accumulator's pending state, the RNG that the resume restores).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from test_auto import Fits
from test_resume import LOADERS, assert_bitwise, build, train, uninterrupted

import fullbatch as fb


def snapshot(objs: tuple[Any, ...]) -> tuple[Any, ...]:
    model, opt, sched, acc = objs
    return (
        copy.deepcopy(model.state_dict()),
        copy.deepcopy(opt.state_dict()),
        sched.state_dict(),
        acc.steps,
        acc.skipped_windows,
    )


def assert_unchanged(before: tuple[Any, ...], objs: tuple[Any, ...]) -> None:
    after = snapshot(objs)
    for a, b in zip(before[0].values(), after[0].values(), strict=True):
        assert torch.equal(a, b)
    assert _same(before[1], after[1]), "optimizer state changed"
    assert before[2:] == after[2:]
    assert all(p.grad is None for p in objs[0].parameters())


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def saved(mode: str, stop: tuple[int, int | None]) -> list[Any]:
    objs = build(mode)
    torch.manual_seed(123)
    states = train(objs, LOADERS[mode], stop)
    assert states is not None
    objs[3].close()
    return states


def fresh(states: list[Any], skip: tuple[int, ...] = ()) -> tuple[Any, ...]:
    """New objects (another initialization) with the saved states loaded, but ``skip``'s."""
    objs = build(states[3]["mode"], seed=7)
    for i, (obj, state) in enumerate(zip(objs, states, strict=True)):
        if i not in skip:
            obj.load_state_dict(state)
    return objs


def resume_correctly(mode: str, objs: tuple[Any, ...], states: list[Any]) -> None:
    assert train(objs, LOADERS[mode][states[3]["loader_items"] :]) is None
    model, acc = uninterrupted(mode)
    assert_bitwise(model, objs[0])
    assert objs[3].steps == acc.steps


def wrong_starts(n: int, items: int) -> list[int]:
    """Item 0, one before, one after and two after ``n`` (distinct, inside the loader)."""
    return sorted({s for s in (0, n - 1, n + 1, n + 2) if 0 <= s <= items and s != n})


# state["loader_items"] at each stop: window 1 begins at item K (4) or 1; after its step, the
# next window begins at item 2K (8) or 2.
AT = {
    ("micro_batches", (1, 2)): 4,
    ("micro_batches", (1, None)): 8,
    ("micro_batch_size", (1, 2)): 1,
    ("micro_batch_size", (1, None)): 2,
}
CASES = [
    (mode, stop, start)
    for (mode, stop), n in AT.items()
    for start in wrong_starts(n, len(LOADERS[mode]))
]


@pytest.mark.parametrize(
    ("mode", "stop", "start"),
    CASES,
    ids=[f"{m}-{'inside' if s[1] else 'boundary'}-from_item_{i}" for m, s, i in CASES],
)
def test_a_loader_at_the_wrong_position_raises(
    mode: str, stop: tuple[int, int | None], start: int
) -> None:
    states = saved(mode, stop)
    n = states[3]["loader_items"]
    assert n == AT[mode, stop]
    objs = fresh(states)
    before = snapshot(objs)
    with pytest.raises(ValueError, match=rf"does not start at state\['loader_items'\] = {n}\b"):
        train(objs, LOADERS[mode][start:])
    assert_unchanged(before, objs)
    resume_correctly(mode, objs, states)  # the refused attempt left the state pending


@pytest.mark.parametrize("stop", [(1, 2), (1, None)], ids=["inside", "boundary"])
def test_an_optimizer_left_unloaded_raises(stop: tuple[int, int | None]) -> None:
    mode = "micro_batches"
    states = saved(mode, stop)
    objs = fresh(states, skip=(1,))  # the optimizer's state is not loaded
    before = snapshot(objs)
    steps = stop[0] + (stop[1] is None)  # optimizer steps taken before the state was saved
    match = (
        rf"holds state for 0 parameter\(s\), "
        rf"the run that saved it held state for 4 at step {steps}\b"
    )
    with pytest.raises(RuntimeError, match=match):
        train(objs, LOADERS[mode][states[3]["loader_items"] :])
    assert_unchanged(before, objs)
    objs[1].load_state_dict(states[1])
    resume_correctly(mode, objs, states)


def test_an_accumulator_left_unloaded_while_the_scheduler_was_raises() -> None:
    mode = "micro_batches"
    states = saved(mode, (1, None))
    objs = fresh(states, skip=(3,))  # model, optimizer and scheduler loaded; not the Accumulator
    before = snapshot(objs)
    with pytest.raises(RuntimeError) as caught:
        train(objs, LOADERS[mode][states[3]["loader_items"] :])
    message = str(caught.value)
    assert "the scheduler's state was loaded" in message
    assert "and the Accumulator's was not" in message
    assert "acc.load_state_dict(state)" in message
    assert "Delete your scheduler.step()" not in message  # a call the user never made
    assert_unchanged(before, objs)
    objs[3].load_state_dict(states[3])
    resume_correctly(mode, objs, states)


def test_the_correct_resume_raises_nothing() -> None:
    """Every check passes on the correct resume (the loader, optimizer and scheduler right)."""
    mode = "micro_batch_size"
    states = saved(mode, (1, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resume_correctly(mode, fresh(states), states)


def test_a_state_inside_an_auto_retry_is_refused() -> None:
    """After an "auto" retry the window is the retried one: a state inside it is refused like
    any "auto" mid-window state (it used to be a boundary state that skipped the window)."""

    def run(check: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), Fits(3)).double()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        refused: list[str] = []

        def fn(micro: dict[str, torch.Tensor]) -> Any:
            if check:
                with pytest.raises(RuntimeError, match=r"inside window 0 with an 'auto' size"):
                    acc.state_dict()
                refused.append("yes")
            return fb.cross_entropy_sum(model(micro["x"]), micro["y"])

        g = torch.Generator().manual_seed(5)
        data = [{"x": torch.randn(8, 6, generator=g).double(), "y": torch.arange(8) % 5}]
        with fb.Accumulator(model, opt, micro_batch_size="auto") as acc:
            for window in acc.windows(data):
                stats = window.run(fn)
        assert stats.retries == 2 and acc.micro_batch_size == 2  # 8 -> 4 -> 2 rows
        if check:
            assert len(refused) == 1 + 1 + 4  # each attempt's micro-batches, the retries' too
        return [p.detach().clone() for p in model.parameters()]

    checked, plain = run(check=True), run(check=False)
    assert all(torch.equal(a, b) for a, b in zip(checked, plain, strict=True))

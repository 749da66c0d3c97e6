"""Resume checks the model's parameters and the optimizer's state, as it checks the loader.

A model whose state was not loaded (its fresh initialization) or was loaded from an older
checkpoint, and an optimizer whose state was not loaded while DCP's ``get_state_dict(model,
optimizer)`` gave it a zeroed template at step 1 (AdamW, SGD with momentum: the step count
matches the saving run's, only the state's contents tell), each raise ``ValueError`` naming what
was not loaded, with nothing changed; the correct resume on the same objects that follows stays
silent and is bitwise the uninterrupted run. The sums are taken at save and at the first window
after a load, never per micro-batch.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from test_resume import LOADERS, assert_bitwise, build, train, uninterrupted
from test_resume_mistakes import assert_unchanged, fresh, resume_correctly, saved, snapshot
from torch.distributed.checkpoint.state_dict import get_state_dict

import fullbatch as fb
import fullbatch._engine._checkpoint as checkpoint

MODE = "micro_batches"


def test_a_model_left_unloaded_raises() -> None:
    """The fresh model keeps its own initialization: every parameter differs."""
    states = saved(MODE, (1, 2))
    objs = fresh(states, skip=(0,))
    before = snapshot(objs)
    with pytest.raises(ValueError, match=r"model's parameters are not the ones saved") as caught:
        train(objs, LOADERS[MODE][states[3]["loader_items"] :])
    assert "4 of 4 trained parameter(s) (0.weight, 0.bias, 4.weight, ...)" in str(caught.value)
    assert "model.load_state_dict" in str(caught.value)
    assert_unchanged(before, objs)
    objs[0].load_state_dict(states[0])
    resume_correctly(MODE, objs, states)


@pytest.mark.parametrize("stop", [(1, 2), (2, None)], ids=["inside", "boundary"])
def test_a_model_from_an_older_checkpoint_raises(stop: tuple[int, int | None]) -> None:
    """Model weights from a checkpoint one step older, everything else current."""
    older = saved(MODE, (stop[0] - 1, 1))  # inside the window before: one step fewer
    states = saved(MODE, stop)
    objs = fresh(states, skip=(0,))
    objs[0].load_state_dict(older[0])
    before = snapshot(objs)
    with pytest.raises(ValueError, match=r"not the ones saved with this state: 4 of 4"):
        train(objs, LOADERS[MODE][states[3]["loader_items"] :])
    assert_unchanged(before, objs)
    objs[0].load_state_dict(states[0])
    resume_correctly(MODE, objs, states)


def build_sgd(seed: int = 0) -> tuple[Any, ...]:
    model, _, _, _ = build(MODE, seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched, fb.Accumulator(model, opt, scheduler=sched, micro_batches=4)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd_momentum"])
def test_dcp_template_optimizer_state_raises(optimizer: str) -> None:
    """Saved after the first step; resumed with the model, scheduler and Accumulator loaded
    and the optimizer holding DCP's template (zeros at step 1, what ``get_state_dict`` gives a
    fresh optimizer): its progress matches (state for 4 parameters, step 1), its contents do
    not."""
    make = build_sgd if optimizer == "sgd_momentum" else lambda seed=0: build(MODE, seed)
    objs = make()
    torch.manual_seed(123)
    states = train(objs, LOADERS[MODE], (1, 0))  # window 1 handed out: 1 step taken
    assert states is not None and states[3]["steps"] == 1
    objs[3].close()

    objs = make(7)
    for i in (0, 2, 3):
        objs[i].load_state_dict(states[i])
    get_state_dict(objs[0], objs[1])  # the template: the optimizer's state is now zeros
    assert objs[1].state and all(
        not t.any() for s in objs[1].state.values() for k, t in s.items() if k != "step"
    )
    before = snapshot(objs)
    with pytest.raises(ValueError, match=r"optimizer's state is not the one saved") as caught:
        train(objs, LOADERS[MODE][states[3]["loader_items"] :])
    assert "get_state_dict(model, optimizer) gives a fresh optimizer a zeroed" in str(caught.value)
    assert_unchanged(before, objs)
    objs[1].load_state_dict(states[1])

    reference = make()
    torch.manual_seed(123)
    train(reference, LOADERS[MODE])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(objs, LOADERS[MODE][states[3]["loader_items"] :])
    assert_bitwise(reference[0], objs[0])


def test_the_sums_are_taken_at_save_and_at_the_first_window_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No per-micro-batch cost: one sum per parameter and per optimizer state tensor when a
    state is saved, the same once when it is resumed, none otherwise."""
    calls = []
    real = checkpoint.tensor_sums
    monkeypatch.setattr(checkpoint, "tensor_sums", lambda t: calls.append(1) or real(t))
    model, _ = uninterrupted(MODE)  # 4 windows, 14 micro-batches, no state taken
    assert calls == []
    per_state = 4 + 4 * 3  # 4 parameters; AdamW: step, exp_avg, exp_avg_sq each
    states = saved(MODE, (1, 2))
    assert len(calls) == per_state
    objs = fresh(states)
    train(objs, LOADERS[MODE][states[3]["loader_items"] :])
    assert len(calls) == 2 * per_state
    assert_bitwise(model, objs[0])


def test_a_state_without_sums_still_loads() -> None:
    """A state saved before the sums existed (or with them deleted on purpose) resumes."""
    states = saved(MODE, (1, 2))
    del states[3]["fingerprints"]
    objs = fresh(states)
    resume_correctly(MODE, objs, states)


def test_the_sums_see_every_bit() -> None:
    from fullbatch._base._fingerprint import tensor_sums

    x = torch.randn(1000, dtype=torch.float64)
    y = x.clone()
    y[517] = torch.nextafter(y[517], torch.tensor(2.0, dtype=torch.float64))  # one ulp
    assert not torch.equal(tensor_sums(x), tensor_sums(y))
    assert torch.equal(tensor_sums(x), tensor_sums(x.flip(0).flip(0)))
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.bool):
        t = torch.arange(7).to(dtype)
        assert tensor_sums(t).dtype == torch.int64
        assert torch.equal(tensor_sums(t), tensor_sums(t.clone()))
    # chunked sums equal one sum (integer sums modulo 2**64 do not depend on the order)
    big = torch.randn(3 * (1 << 22) + 5)
    bits = big.view(torch.int32).to(torch.int64)
    assert torch.equal(tensor_sums(big), torch.stack([bits.sum(), (bits * bits).sum()]))

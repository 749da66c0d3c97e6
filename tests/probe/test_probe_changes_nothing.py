"""A probed run ends bitwise equal to the same run without the probe (CPU), dropout and
train-mode BatchNorm included, and every hook is gone after the probed windows."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn.modules import module as module_hooks
from torch.optim import optimizer as optimizer_hooks

import fullbatch as fb
from _probe_cases import accumulate, make_net, micro_batches, objective, train

WINDOWS = [micro_batches((2, 3, 4), seed=s) for s in range(4)]


def _run(probe_kwargs: dict | None, dtype: torch.dtype) -> tuple[dict, dict, torch.Tensor, object]:
    torch.manual_seed(123)
    model = make_net(dropout=0.3, batchnorm=True, dtype=dtype).train()
    windows = [[{k: v.to(dtype) if v.is_floating_point() else v for k, v in m.items()} for m in w]
               for w in WINDOWS]  # fmt: skip
    opt_state: dict = {}
    report = None

    def draw() -> None:  # the loop draws random numbers between its last forward and step()
        torch.rand(3)

    if probe_kwargs is None:
        train(model, windows, "mean/K", before_step=draw)
    else:
        with fb.probe(**probe_kwargs) as probe:
            train(model, windows, "mean/K", before_step=draw)
        report = probe.report
    state = copy.deepcopy(model.state_dict())  # parameters and BatchNorm buffers
    return state, opt_state, torch.get_rng_state(), report


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_probed_run_is_bitwise_the_unprobed_run(dtype: torch.dtype) -> None:
    plain, _, rng_plain, _ = _run(None, dtype)
    probed, _, rng_probed, report = _run({"objective": objective, "windows": 2}, dtype)
    assert len(report.windows) == 2  # it did check (and found the mean of means)
    assert report.windows[0].pattern == "mean of per-micro-batch means"
    assert plain.keys() == probed.keys()
    for name in plain:
        assert torch.equal(plain[name], probed[name]), name  # bitwise, buffers included
    assert torch.equal(rng_plain, rng_probed)


def test_buffers_rng_grads_and_optimizer_state_untouched_at_the_step() -> None:
    """Right at step(), after the probe's recompute: .grad, BatchNorm statistics, RNG state and
    optimizer state are what the loop left."""
    model = make_net(dropout=0.3, batchnorm=True).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    seen: dict = {}

    def before(optimizer, args, kwargs):  # registered after the probe's: runs after it
        seen["grads"] = [p.grad.clone() for p in model.parameters()]
        seen["buffers"] = [b.clone() for b in model.buffers()]
        seen["rng"] = torch.get_rng_state()
        seen["state"] = copy.deepcopy(optimizer.state_dict())

    with fb.probe(model, opt, objective=objective) as probe:
        handle = opt.register_step_pre_hook(before)
        for micro in WINDOWS[0]:
            loss_sum, _n = fb.cross_entropy_sum(model(micro), micro["labels"])
            (loss_sum / 9).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        buffers = [b.clone() for b in model.buffers()]
        rng = torch.get_rng_state()
        state = copy.deepcopy(opt.state_dict())
        opt.step()
        handle.remove()
    assert len(probe.report.windows) == 1
    assert all(torch.equal(a, b) for a, b in zip(grads, seen["grads"], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(buffers, seen["buffers"], strict=True))
    assert torch.equal(rng, seen["rng"]) and state == seen["state"]


def _ours() -> dict[str, int]:
    return {
        "forward_pre": len(module_hooks._global_forward_pre_hooks),
        "forward": len(module_hooks._global_forward_hooks),
        "step_pre": len(optimizer_hooks._global_optimizer_pre_hooks),
    }


def test_hooks_are_gone_after_the_probed_windows() -> None:
    before = _ours()
    clip = torch.nn.utils.clip_grad._clip_grads_with_norm_  # what clip_grad_norm_ calls
    model = make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with fb.probe(objective=objective, windows=1) as probe:
        assert _ours() != before and torch.nn.utils.clip_grad._clip_grads_with_norm_ is not clip
        for i, window in enumerate(WINDOWS[:3]):
            for micro in window:
                fb.cross_entropy_sum(model(micro), micro["labels"])[0].backward()
            opt.step()
            opt.zero_grad()
            if i >= 1:  # the first forward after the probed window took the last hook away
                assert _ours() == before and torch.nn.utils.clip_grad._clip_grads_with_norm_ is clip
    assert _ours() == before
    assert len(probe.report.windows) == 1


def test_hooks_are_gone_when_the_block_raises() -> None:
    before = _ours()
    model = make_net()
    with pytest.raises(KeyError), fb.probe(objective=objective):
        model(WINDOWS[0][0])
        raise KeyError("the user's error")
    assert _ours() == before


def test_explicit_model_and_wrapped_optimizer() -> None:
    """``fb.probe(model, optimizer)``: per-object hooks only; a wrapper's inner optimizer."""

    class Wrapper:  # as Accelerate and Lightning wrap the torch optimizer
        def __init__(self, optimizer):
            self.optimizer = optimizer

    model = make_net()
    other = make_net(seed=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = _ours()
    with fb.probe(model, Wrapper(opt), objective=objective) as probe:
        assert _ours() == before  # no global hook
        other(WINDOWS[0][0])  # another module: not recorded
        accumulate(model, WINDOWS[0], "global")
        opt.step()
    (check,) = probe.report.windows
    assert probe.report.ok and check.micro_batches == 3

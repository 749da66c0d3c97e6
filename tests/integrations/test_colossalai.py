"""ColossalAI's Booster objects, recognised without importing ColossalAI (which pins an old torch).

The stand-ins in ``tests/_colossal_cases.py`` have ColossalAI's class names, modules and
structure. ``TorchDDPPlugin``'s boosted model and ``OptimizerWrapper`` train exactly on 2 gloo
ranks (every rank, every step, against a float64 full batch written in plain PyTorch), the
same as the inner DDP model and optimizer passed by hand, with the same collectives; plugins
that keep gradients outside ``.grad`` (ZeRO, Gemini) are refused before anything changes.
"""

from __future__ import annotations

import pytest
import torch

import _colossal_cases as cc
import fullbatch as fb
from _dist import run_ranks, values
from _dist_cases import make_model, make_optimizer, two_backwards_reference

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("route", ["boosted", "inner_optimizer"])
def test_boosted_ddp_objects_train_the_full_batch_on_two_ranks(route: str) -> None:
    """ColossalAI's natural route (``fb.Accumulator(model, optimizer)`` on the boosted objects)
    used to raise AttributeError ('OptimizerWrapper' has no register_step_pre_hook); the boosted
    model with the inner optimizer trained 16-18% off with ranks diverging. Both are now the
    by-hand route (``model.module``, ``optimizer.optim``), bitwise, with the same collectives."""
    ref = two_backwards_reference()
    got = values(run_ranks(cc.boosted, 2, route))
    by_hand = values(run_ranks(cc.boosted, 2, "by_hand"))
    for rank, (res, hand) in enumerate(zip(got, by_hand, strict=True)):
        assert len(res["params"]) == len(ref) == 2
        for step, (p, q) in enumerate(zip(res["params"], ref, strict=True)):
            torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14, msg=f"rank {rank} step {step}")
        for p, q in zip(res["params"], hand["params"], strict=True):
            assert torch.equal(p, q)
        assert res["calls"] == hand["calls"]
        # ddp_sync="step", per window: DDP reduces nothing itself (no sync per backward),
        # fullbatch sums the whole gradient once and issues small collectives (counts, stats)
        for calls in res["calls"]:
            assert calls["buckets"] == 0, calls
            assert calls["all_reduce"].count(res["n_params"]) == 1, calls
            assert all(n <= 8 for n in calls["all_reduce"] if n != res["n_params"]), calls
        assert res["acc_model_is_ddp"] and res["acc_optimizer_is_inner"]
        assert not [w for w in res["warnings"] if "Wrap the model" in w or ".module" in w]


def _untouched(model: torch.nn.Module, opt: torch.optim.Optimizer, before: list) -> None:
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert not opt.state and not opt._optimizer_step_pre_hooks
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(
    ("model_cls", "opt_cls", "match"),
    [
        (cc.LowLevelZeroModel, cc.OptimizerWrapper, r"LowLevelZeroModel.*ZeRO.*TorchDDPPlugin"),
        (cc.ModelWrapper, cc.LowLevelZeroOptimizer, r"LowLevelZeroOptimizer.*ZeRO"),
        (cc.GeminiDDP, cc.GeminiOptimizer, r"GeminiDDP.*Gemini keeps gradients"),
        (cc.ModelWrapper, cc.GeminiOptimizer, r"GeminiOptimizer.*Gemini keeps gradients"),
    ],
)
def test_plugins_with_gradients_outside_grad_are_refused(
    model_cls: type, opt_cls: type, match: str
) -> None:
    inner = make_model()
    opt = make_optimizer(inner.parameters())
    before = [p.detach().clone() for p in inner.parameters()]
    with pytest.raises(ValueError, match=match):
        fb.Accumulator(model_cls(inner), opt_cls(opt), micro_batches=2)
    _untouched(inner, opt, before)


def test_torch_amp_optimizer_needs_its_scaler() -> None:
    inner = make_model()
    opt = make_optimizer(inner.parameters())
    boosted = cc.TorchAMPOptimizer(opt)
    before = [p.detach().clone() for p in inner.parameters()]
    with pytest.raises(ValueError, match=r"TorchAMPOptimizer.*scaler=optimizer\.scaler"):
        fb.Accumulator(cc.ModelWrapper(inner), boosted, micro_batches=2)
    _untouched(inner, opt, before)
    acc = fb.Accumulator(cc.ModelWrapper(inner), boosted, micro_batches=2, scaler=boosted.scaler)
    assert acc.optimizer is opt
    acc.close()


def test_a_model_wrapper_on_one_process_trains_the_full_batch() -> None:
    """The nearest correct form on one process: a ModelWrapper (no DDP) and an
    OptimizerWrapper, against one float64 full batch per window."""
    model = cc.ModelWrapper(make_model())
    opt = cc.OptimizerWrapper(make_optimizer(model.parameters()))
    ref_model = make_model()
    ref_opt = make_optimizer(ref_model.parameters())
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(r, 6, dtype=torch.float64, generator=g),
             torch.randint(0, 4, (r,), generator=g)) for r in (3, 1, 4, 2)]  # fmt: skip
    with fb.Accumulator(model, opt, micro_batches=2) as acc:
        for w, window in enumerate(acc.windows(data)):
            for x, y in window:
                window.backward(*fb.cross_entropy_sum(model(x), y))
            window.step()
            x = torch.cat([d[0] for d in data[2 * w : 2 * w + 2]])
            y = torch.cat([d[1] for d in data[2 * w : 2 * w + 2]])
            ref_opt.zero_grad()
            torch.nn.functional.cross_entropy(ref_model(x), y).backward()
            ref_opt.step()
            for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
                torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)
    assert acc.steps == 2

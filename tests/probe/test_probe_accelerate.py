"""``fb.probe`` on an Accelerate loop: ``accelerator.accumulate()`` with each micro-batch's
mean loss is flagged (the probe checks the torch optimizer inside ``AcceleratedOptimizer``);
``fb.Accumulator`` on the same prepared objects passes. Judged against a plain full batch."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import fullbatch as fb
from _accelerate_cases import LR, MICRO_BATCHES, MICRO_ROWS, lm_loss, loader, mean_loss, rows, stack
from conftest import make_lm, ref_mean_loss

pytest.importorskip("accelerate")
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

WINDOW = MICRO_ROWS * MICRO_BATCHES


@pytest.fixture(autouse=True)
def _fresh_accelerate() -> Any:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _prepared(**kwargs: Any) -> tuple[Any, torch.nn.Module, Any, Any, Any]:
    accelerator = Accelerator(cpu=True, **kwargs)
    model = make_lm()
    start = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model, opt, dl = accelerator.prepare(model, opt, loader(rows()))
    return accelerator, start, model, opt, dl


def _reference(start: torch.nn.Module) -> list[torch.Tensor]:
    ref_mean_loss(start, stack(rows()[:WINDOW])).backward()
    return [p.grad.clone() for p in start.parameters()]


def _rel(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    diff = sum(float((g - r).pow(2).sum()) for g, r in zip(got, ref, strict=True))
    return (diff / sum(float(r.pow(2).sum()) for r in ref)) ** 0.5


def test_accumulate_with_a_mean_loss_is_flagged() -> None:
    accelerator, start, model, opt, dl = _prepared(gradient_accumulation_steps=MICRO_BATCHES)
    grads: list[list[torch.Tensor]] = []
    with fb.probe(objective="causal_lm") as probe:
        for batch in dl:
            with accelerator.accumulate(model):
                accelerator.backward(mean_loss(model, batch))
                if accelerator.sync_gradients:
                    grads.append([p.grad.clone() for p in model.parameters()])
                opt.step()
                opt.zero_grad()
    check = probe.report.windows[0]  # the first of the windows checked
    assert not probe.report.ok and check.engine == "Accelerate"
    assert check.pattern == "mean of per-micro-batch means" and check.micro_batches == 4
    assert "fb.Accumulator" in check.diagnosis
    assert check.error == pytest.approx(_rel(grads[0], _reference(start)), rel=1e-9)


def test_accumulator_on_prepared_objects_passes() -> None:
    _, start, model, opt, dl = _prepared()
    grads: list[list[torch.Tensor]] = []
    with fb.probe(objective="causal_lm", windows=2) as probe:
        acc = fb.Accumulator(model, opt, micro_batches=MICRO_BATCHES)
        acc.register_window_hook(lambda: grads.append([p.grad.clone() for p in model.parameters()]))
        for window in acc.windows(dl):
            for micro in window:
                window.backward(*lm_loss(model, micro))
            window.step()
        acc.close()
    assert probe.report.ok, str(probe.report)
    assert [w.engine for w in probe.report.windows] == ["fb.Accumulator"] * 2
    assert _rel(grads[0], _reference(start)) < 1e-12

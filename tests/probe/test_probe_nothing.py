"""The probe never passes on nothing, refuses what it cannot check by name, and its errors name
the fix; a raising probe leaves parameters and optimizer state as they were."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fullbatch as fb
from _probe_cases import IGNORE, accumulate, make_net, micro_batches, objective

WINDOW = micro_batches((2, 3))


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[list[torch.Tensor], dict]:
    return [p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict())


def _unchanged(model, opt, saved) -> bool:
    params, state = saved
    now = opt.state_dict()
    same_state = (
        now["param_groups"] == state["param_groups"]
        and all(
            torch.equal(now["state"][i]["momentum_buffer"], s["momentum_buffer"])
            for i, s in state["state"].items()
        )
        and now["state"].keys() == state["state"].keys()
    )
    return (
        all(torch.equal(a, b) for a, b in zip(params, model.parameters(), strict=True))
        and same_state
    )


def test_no_optimizer_step() -> None:
    model = make_net()
    with fb.probe(objective=objective) as probe:
        accumulate(model, WINDOW, "global")
    assert not probe.report.ok and probe.report.windows == ()
    assert "no optimizer step was seen" in probe.report.problems[0]
    assert str(probe.report).startswith("fullbatch probe: NOTHING CHECKED")


def test_step_without_a_micro_batch() -> None:
    model = make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    accumulate(model, WINDOW, "global")  # gradients from before the block
    with fb.probe(objective=objective) as probe:
        opt.step()
    (check,) = probe.report.windows
    assert not probe.report.ok and check.pattern == "nothing to check"
    assert "no micro-batch ran" in check.diagnosis


def test_forward_without_gradients_is_no_micro_batch() -> None:
    model = make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    accumulate(model, WINDOW, "global")
    with fb.probe(objective=objective) as probe:
        with torch.no_grad():
            model(WINDOW[0])  # an evaluation, not part of the window
        opt.step()
    assert probe.report.windows[0].pattern == "nothing to check" and not probe.report.ok


def test_forwards_without_a_backward() -> None:
    """Forwards whose output reaches no backward are no micro-batches: nothing to check."""
    model = make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with fb.probe(objective=objective) as probe:
        for micro in WINDOW:
            model(micro)  # forward, no backward
        opt.step()
    (check,) = probe.report.windows
    assert not check.ok and check.pattern == "nothing to check"
    assert "2 forwards ran with gradients but reached no backward" in check.diagnosis


def test_missing_gradient() -> None:
    """Micro-batches that reached a backward, and no gradient left at the step."""
    model = make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with fb.probe(objective=objective) as probe:
        for micro in WINDOW:
            fb.cross_entropy_sum(model(micro), micro["labels"])[0].backward()
        opt.zero_grad(set_to_none=True)  # cleared before the step
        opt.step()
    (check,) = probe.report.windows
    assert (
        not check.ok
        and check.pattern == "dropped"
        and "zero or missing gradient" in check.diagnosis
    )


def test_zero_gradient() -> None:
    model = make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with fb.probe(objective=objective) as probe:
        for micro in WINDOW:
            (model(micro).sum() * 0).backward()
        opt.step()
    assert probe.report.windows[0].pattern == "dropped" and not probe.report.ok


def test_window_without_counted_items() -> None:
    model = make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    window = [{**m, "labels": torch.full_like(m["labels"], IGNORE)} for m in WINDOW]
    with fb.probe(objective=objective) as probe:
        for micro in window:
            model(micro).sum().backward()
        opt.step()
    (check,) = probe.report.windows
    assert (
        not check.ok
        and check.pattern == "nothing to check"
        and "no counted items" in check.diagnosis
    )


def test_objective_none_on_a_model_it_cannot_infer_raises_naming_the_choices() -> None:
    model = make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    accumulate(model, WINDOW, "global")
    opt.step()  # momentum state exists
    opt.zero_grad()
    saved = _state(model, opt)
    with pytest.raises(ValueError, match=r"objective='causal_lm'.*'token'.*'sample'.*fn\(model"):
        with fb.probe():
            accumulate(model, WINDOW, "global")
            opt.step()
    assert _unchanged(model, opt, saved)  # the step did not happen


def test_builtin_objective_without_labels_raises() -> None:
    model = nn.Linear(6, 5).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    saved = _state(model, opt)
    with pytest.raises(ValueError, match=r"needs labels.*objective=fn\(model, micro\)"):
        with fb.probe(objective="sample"):
            x = torch.randn(3, 6, dtype=torch.float64)
            model(x).sum().backward()
            opt.step()
    assert _unchanged(model, opt, saved)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"windows": 0}, "windows must be a positive int"),
        ({"windows": True}, "windows must be a positive int"),
        ({"objective": "mean"}, "objective='mean' is not known"),
        ({"ranks": "all"}, "ranks='all'"),
        ({"model": "net"}, "model must be an nn.Module"),
        ({"optimizer": object()}, "optimizer must be a torch.optim.Optimizer"),
    ],
)
def test_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fb.probe(**kwargs)


def test_flat_parameters_are_refused_by_name() -> None:
    model = make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.inp.weight._is_flat_param = True  # what FSDP1's FlatParameter carries
    with fb.probe(objective=objective) as probe:
        accumulate(model, WINDOW, "global")
        opt.step()
    assert not probe.report.ok and probe.report.windows == ()  # unsupported: nothing judged
    assert "FSDP1" in probe.report.problems[0] and "unsupported" in probe.report.problems[0]


def test_an_engine_that_keeps_gradients_elsewhere_is_refused_by_name() -> None:
    class GeminiDDP(nn.Module):  # the class name ColossalAI's Gemini wrapper has
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

        def forward(self, batch):
            return self.module(batch)

    model = make_net()
    engine = GeminiDDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with fb.probe(objective=objective) as probe:
        for micro in WINDOW:
            fb.cross_entropy_sum(engine(micro), micro["labels"])[0].backward()
        opt.step()
    assert not probe.report.ok and probe.report.windows == ()
    assert "Gemini" in probe.report.problems[0] and "unsupported" in probe.report.problems[0]


def test_clip_grad_value_is_refused() -> None:
    model = make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with fb.probe(objective=objective) as probe:
        accumulate(model, WINDOW, "global")
        torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)
        opt.step()
    assert probe.report.windows[0].pattern == "unsupported" and not probe.report.ok

"""Who stepped the optimizer is read from what fullbatch's routes declare, never from class-name
strings or another module's local variables; foreign engines are named by their package."""

from __future__ import annotations

import importlib

import pytest
import torch

import fullbatch as fb
from _probe_cases import make_net, micro_batches, objective
from fullbatch._probe._engines import Engine, declared_route, find_engine
from fullbatch._probe._fixes import fix

ROUTES = {
    "fullbatch.hf:ExactTrainer": "fullbatch.hf.ExactTrainer",
    "fullbatch.trl:ExactSFTTrainer": "fullbatch.trl.ExactSFTTrainer",
    "fullbatch.trl:ExactDPOTrainer": "fullbatch.trl.ExactDPOTrainer",
    "fullbatch.trl:ExactGRPOTrainer": "fullbatch.trl.ExactGRPOTrainer",
    "fullbatch.lightning:ExactAccumulation": "fullbatch.lightning.ExactAccumulation",
}


@pytest.mark.parametrize("where", sorted(ROUTES))
def test_every_wing_declares_its_route(where: str) -> None:
    """``ExactGRPOTrainer`` does not subclass ``ExactTrainer``: its declaration is its own."""
    module_name, _, name = where.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except ImportError as error:
        pytest.skip(f"{module_name}: {error}")
    assert cls.__dict__["fullbatch_route"] == ROUTES[where]
    assert declared_route(object.__new__(cls)) == ROUTES[where]


class _Wing:
    fullbatch_route = "fullbatch.example.Wing"

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()


class _UsersWing(_Wing):
    pass


class GRPOTrainer:  # a foreign class of the same name as TRL's, outside trl: not TRL
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()


def _engine_of(stepper: object) -> Engine:
    model = make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[Engine] = []
    opt.register_step_pre_hook(lambda *a: seen.append(find_engine()) and None)
    objective(model, micro_batches([2])[0])[0].backward()
    stepper.step(opt)  # type: ignore[attr-defined]
    return seen[0]


def test_a_declared_route_is_recognised_and_a_subclass_named_beside_it() -> None:
    assert _engine_of(_Wing()) == Engine("fullbatch.example.Wing", fullbatch=True)
    users = _engine_of(_UsersWing())
    assert users.fullbatch and users.name == "fullbatch.example.Wing (_UsersWing)"


def test_a_class_name_alone_names_no_engine() -> None:
    assert _engine_of(GRPOTrainer()) == Engine("a hand-written loop")


def test_a_fullbatch_route_is_never_told_to_use_itself() -> None:
    """The fix on fullbatch's own GRPO route points at its loss, not at itself."""
    own = Engine("fullbatch.trl.ExactGRPOTrainer", fullbatch=True)
    stock = Engine("trl.GRPOTrainer", package="trl", trainer="GRPOTrainer")
    assert "use fullbatch.trl.ExactGRPOTrainer" not in fix("not normalized", own)
    assert "fullbatch's own route" in fix("not normalized", own)
    assert "use fullbatch.trl.ExactGRPOTrainer in place of trl.GRPOTrainer" in fix(
        "not normalized", stock
    )


def test_the_accumulator_publishes_its_verdict_not_its_locals() -> None:
    """The probe reads the clip from the window's declaration (the engine's published verdict):
    renaming step_window's local variables cannot change what it finds."""
    from fullbatch._engine import _step

    assert "verdict" in _step.step_window.__code__.co_varnames  # the old frame-read target
    model = make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    window = micro_batches([3, 2])
    with fb.probe(objective=objective) as probe:
        acc = fb.Accumulator(model, opt, micro_batches=2, max_grad_norm=1e-3)
        for w in acc.windows(window):
            for micro in w:
                w.backward(*objective(model, micro))
            stats = w.step()
    (check,) = probe.report.windows
    assert probe.report.ok and check.engine == "fb.Accumulator"
    assert check.clip == (1e-3, pytest.approx(stats.grad_norm))


def test_fullbatchs_grpo_trainer_is_taken_for_itself_not_for_trl() -> None:
    """It subclasses ``trl.GRPOTrainer`` and not ``ExactTrainer``: by class names and packages
    it looked like a stock TRL trainer, whose fix would tell its user to use it."""
    trl = pytest.importorskip("fullbatch.trl")
    trainer = object.__new__(trl.ExactGRPOTrainer)

    def step(self: object, optimizer: torch.optim.Optimizer) -> None:  # a method's frame
        optimizer.step()

    engine = _engine_of(type("Stepper", (), {"step": lambda _, opt: step(trainer, opt)})())
    assert engine == Engine("fullbatch.trl.ExactGRPOTrainer", fullbatch=True)

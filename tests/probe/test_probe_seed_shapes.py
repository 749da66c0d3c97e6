"""``fb.probe`` on the shapes of the engines of ``benchmarks/seed_frameworks.py --probe``
(Composer, Super-Gradients, ColossalAI), which CI cannot install (they pin older torch).

Where the built-in objectives find the labels when no frame holds a micro-batch mapping with
them: Composer calls ``model(state.batch)`` (a mapping with ``labels`` passed whole, kept on an
object, not in a local), Super-Gradients unpacks ``inputs, targets`` and calls ``net(inputs)``,
an ``fb.Accumulator`` loop runs ``for x, labels in window``; each is judged against the plain
full batch of ``tests/_probe_cases.py``, and a model output left in a local named ``y`` is
never taken for the labels. The engine is named by its classes' package (none imported), with
its fix; ColossalAI's ``OptimizerWrapper`` only when no ``fb.Accumulator`` steps through it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fullbatch as fb
from _colossal_cases import OptimizerWrapper
from _probe_cases import (
    IGNORE,
    applied,
    counted,
    full_batch_grad,
    make_net,
    micro_batches,
    rel_error,
)

SIZES = (1, 4, 2, 5)


class _State:
    batch: dict[str, torch.Tensor]


class StateTrainer:
    """Composer's shape: the micro-batch lives on ``self.state``; ``model(batch)`` gets it."""

    def __init__(self, model: torch.nn.Module, how: str) -> None:
        self.model, self.how, self.state = model, how, _State()

    def window(self, window: list[dict[str, torch.Tensor]]) -> None:
        total = sum(counted(m) for m in window)
        for i in range(len(window)):  # no local holds the micro-batch mapping
            self.state.batch = window[i]
            out = self.model(self.state.batch)
            if self.how == "mean/K":
                mean = F.cross_entropy(out, self.state.batch["labels"], ignore_index=IGNORE)
                (mean / len(window)).backward()
            else:
                (fb.cross_entropy_sum(out, self.state.batch["labels"])[0] / total).backward()


class UnpackingTrainer:
    """Super-Gradients' shape: ``inputs, targets = batch_items``; ``net(inputs)``; each
    micro-batch's mean loss, never divided by the accumulation count."""

    def __init__(self, net: torch.nn.Module) -> None:
        self.net = net

    def window(self, loader: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for batch_items in loader:
            inputs, targets = batch_items
            outputs = self.net(inputs)
            F.cross_entropy(outputs, targets, ignore_index=IGNORE).backward()


def _window() -> list[dict[str, torch.Tensor]]:
    return micro_batches(SIZES)


def _probed(run, objective: str = "sample"):  # type: ignore[no-untyped-def]
    model = make_net()
    window = _window()
    ref = full_batch_grad(model, window)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with fb.probe(objective=objective) as probe:
        run(model, window)
        got = applied(model)
        opt.step()
    return probe.report, rel_error(got, ref), [counted(m) for m in window]


@pytest.mark.parametrize("how", ["right", "mean/K"])
def test_a_mapping_passed_whole_on_an_object(how: str) -> None:
    report, measured, n = _probed(lambda model, w: StateTrainer(model, how).window(w))
    (check,) = report.windows
    assert check.error == pytest.approx(measured, rel=1e-9, abs=1e-15)
    if how == "right":
        assert report.ok and measured < 1e-13, str(report)
        return
    assert check.pattern == "mean of per-micro-batch means"
    assert check.weights == pytest.approx([sum(n) / (len(n) * k) for k in n], rel=1e-6)


def test_targets_unpacked_beside_the_input() -> None:
    def run(model, window):  # type: ignore[no-untyped-def]
        UnpackingTrainer(model).window([(m["x"], m["labels"]) for m in window])

    report, measured, n = _probed(run)
    (check,) = report.windows
    assert check.error == pytest.approx(measured, rel=1e-9) and measured > 1
    assert check.pattern == "mean of per-micro-batch means" and "x4 (= K" in check.diagnosis
    assert check.weights == pytest.approx([sum(n) / k for k in n], rel=1e-6)


def test_labels_unpacked_in_an_accumulator_loop() -> None:
    def run(model, window):  # type: ignore[no-untyped-def]
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        pairs = [(m["x"], m["labels"]) for m in window]
        with fb.Accumulator(model, opt, micro_batches=len(pairs)) as acc:
            for w in acc.windows(pairs):
                for x, labels in w:
                    w.backward(*fb.cross_entropy_sum(model(x), labels))
                w.step()

    model = make_net()
    window = _window()
    ref = full_batch_grad(model, window)
    before = [p.detach().clone() for p in model.parameters()]
    with fb.probe(objective="sample") as probe:
        run(model, window)
    assert probe.report.ok, str(probe.report)
    moved = [(b - p.detach()) / 0.1 for b, p in zip(before, model.parameters(), strict=True)]
    assert rel_error(moved, ref) < 1e-12 and probe.report.windows[0].error < 1e-12


def test_a_model_output_named_y_is_not_taken_for_labels() -> None:
    model = make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    window = _window()
    xs, targets_list = [m["x"] for m in window], [m["labels"] for m in window]
    params = [p.detach().clone() for p in model.parameters()]
    y = model(xs[-1])  # a model output in a label's name, beside every input below
    with pytest.raises(ValueError, match="needs labels"), fb.probe(objective="sample"):
        for x, t in zip(xs, targets_list, strict=True):
            y = model(x)
            F.cross_entropy(y, t, ignore_index=IGNORE).backward()
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(params, model.parameters(), strict=True))
    assert not opt.state


class Trainer:
    """A trainer that steps the optimizer itself; ``__module__`` set per test to Composer's or
    Super-Gradients' (the probe names engines by their classes' package, importing none)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def fit(self, window: list[dict[str, torch.Tensor]]) -> None:
        for i in range(len(window)):
            mean = F.cross_entropy(self.model(window[i]), window[i]["labels"], ignore_index=IGNORE)
            (mean / len(window)).backward()
        self.optimizer.step()


@pytest.mark.parametrize(
    ("package", "engine", "words"),
    [
        ("composer.trainer.trainer", "Composer", "fullbatch.composer.TokenCounts()"),
        (
            "super_gradients.training.sg_trainer",
            "Super-Gradients",
            "fullbatch.super_gradients.ExactTrainer in place of Trainer",
        ),
    ],
)
def test_engines_named_with_their_fix(
    monkeypatch: pytest.MonkeyPatch, package: str, engine: str, words: str
) -> None:
    monkeypatch.setattr(Trainer, "__module__", package)
    model = make_net()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with fb.probe(objective="sample") as probe:
        trainer.fit(_window())
    (check,) = probe.report.windows
    assert check.engine == engine and check.pattern == "mean of per-micro-batch means"
    assert words in check.diagnosis


def test_colossalai_optimizer_wrapper_names_the_engine_unless_fullbatch_steps_it() -> None:
    model = make_net()
    wrapped = OptimizerWrapper(torch.optim.SGD(model.parameters(), lr=0.1))
    with fb.probe(objective="sample") as probe:
        Trainer(model, wrapped).fit(_window())  # type: ignore[arg-type]
    (check,) = probe.report.windows
    assert check.engine == "ColossalAI" and "on the boosted model" in check.diagnosis
    wrapped.zero_grad(set_to_none=True)
    window = _window()
    with fb.probe(objective="sample") as probe:
        with fb.Accumulator(model, wrapped, micro_batches=len(window)) as acc:
            for w in acc.windows(window):
                for micro in w:
                    w.backward(*fb.cross_entropy_sum(model(micro), micro["labels"]))
                w.step()
    assert probe.report.ok and probe.report.windows[0].engine == "fb.Accumulator"

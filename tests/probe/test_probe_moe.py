"""``fb.probe`` on transformers MoE models (tiny random Mixtral, Qwen3-MoE, OLMoE; float64):
the objective is inferred as ``causal_lm+moe`` (token-mean cross-entropy plus
``router_aux_loss_coef`` times the load-balancing loss over the whole window), and a
load-balancing loss taken per micro-batch is named "a window statistic taken per micro-batch"
with its share of the error. Each run's applied gradient (SGD, lr 1: the parameters' move) is
compared with a plain full-batch gradient written in ``_moe_cases.reference``, so the probe's
verdict and its error are checked against a truth computed here."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import fullbatch as fb
from _moe_cases import COEF, forward, make_moe, moe_rows, reference, routing, split
from fullbatch._probe._export import problems
from fullbatch._probe._window_stat import NAMED, NAMED_SHARE

LENGTHS = (7, 3, 5, 7, 2, 6)
SIZES = (1, 3, 2)
MOE = "causal_lm+moe"


@pytest.fixture(scope="module")
def models() -> dict[str, Any]:
    return {}


def _model(models: dict[str, Any], family: str, **config: Any) -> Any:
    if family not in models:
        models[family] = make_moe(family)
    model = copy.deepcopy(models[family])
    model.config.output_router_logits = True
    for key, value in config.items():
        setattr(model.config, key, value)
        if key == "router_aux_loss_coef":  # as if built with it: the forward multiplies by this
            model.router_aux_loss_coef = value
    return model


def _rows() -> dict[str, torch.Tensor]:
    return moe_rows(LENGTHS, seed=3)


def _error(model: Any, before: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """``‖applied − full batch‖ / ‖full batch‖`` with the applied gradient read off SGD(lr=1)."""
    moved = [b - p.detach() for b, p in zip(before, model.parameters(), strict=True)]
    diff = sum(float((m - w).pow(2).sum()) for m, w in zip(moved, want, strict=True))
    return math.sqrt(diff / sum(float(w.pow(2).sum()) for w in want))


def _loop(model: Any, kind: str, objective: Any = None) -> tuple[Any, float]:
    """One window of 3 uneven micro-batches under the probe; the report and the step's error
    against the full batch of this model's own objective."""
    rows = _rows()
    want, _ = reference(copy.deepcopy(model), rows) if _aux_on(model) else (_ce_only(model), 0)
    micros = split(rows, SIZES)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    with fb.probe(windows=1, objective=objective) as probe:
        if kind == "loss/GA":  # the stock loop: the model's own loss, divided by K
            for m in micros:
                (model(**m).loss / len(micros)).backward()
            opt.step()
        elif kind == "num_items":  # the Trainer's: exact cross-entropy, the aux undivided
            total = sum(fb.count_tokens(m["labels"]) for m in micros)
            for m in micros:
                out = forward(model, m)
                ce, _ = fb.causal_lm_loss(out.logits, m["labels"])
                (ce / total + COEF * out.aux_loss).backward()
            opt.step()
        else:  # exact: window.stats gives every micro-batch the window's routing counts
            tokens = {"tokens": lambda m: fb.count_tokens(m["labels"])}
            acc = fb.Accumulator(model, opt, micro_batches=len(micros), counts=tokens)
            for window in acc.windows(micros):
                counts = window.stats(routing(model)) if _aux_on(model) else None
                for m in window:
                    out = forward(model, m)
                    ce, _ = fb.causal_lm_loss(out.logits, m["labels"])
                    loss = ce / window.totals["tokens"]
                    if counts is not None:
                        mask = m["attention_mask"]
                        aux = fb.moe.load_balancing(out.router_logits, counts, attention_mask=mask)
                        loss = loss + COEF * aux
                    window.backward(loss)
                window.step()
    return probe.report, _error(model, before, want)


def _aux_on(model: Any) -> bool:
    return bool(model.config.output_router_logits and model.router_aux_loss_coef)


def _ce_only(model: Any) -> list[torch.Tensor]:
    """The full batch's gradient of the token-mean cross-entropy alone (aux off)."""
    twin = copy.deepcopy(model)
    rows = _rows()
    out = twin(input_ids=rows["input_ids"], attention_mask=rows["attention_mask"])
    ce, n = fb.causal_lm_loss(out.logits, rows["labels"])
    (ce / n).backward()
    return [torch.zeros_like(p) if p.grad is None else p.grad for p in twin.parameters()]


def test_stock_loss_over_ga_names_both_mistakes(models: dict[str, Any]) -> None:
    """``model(**micro).loss / K``: the cross-entropy a mean of per-micro-batch means, and
    the aux loss per micro-batch, each named; the statistic's share printed; the probe's
    error is the error against the full batch written here."""
    report, truth = _loop(_model(models, "mixtral"), "loss/GA")
    (w,) = report.windows
    assert not report.ok and w.objective == MOE, report
    assert w.patterns == ("mean of per-micro-batch means", NAMED), report
    assert w.statistic_share is not None and 0.001 < w.statistic_share < NAMED_SHARE, report
    assert f"it explains {w.statistic_share:.0%} of the error" in w.diagnosis
    assert "per micro-batch:" in str(report) and "of the error" in str(report)
    assert truth > 0.05 and abs(w.error - truth) <= 1e-6 * truth, (w.error, truth)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "olmoe"])
def test_exact_cross_entropy_with_aux_per_micro_batch_is_the_statistic(
    models: dict[str, Any], family: str
) -> None:
    """The Trainer's recipe (``num_items_in_batch``: the cross-entropy exact, each
    micro-batch's own aux loss undivided): the statistic is the whole error, named first,
    with the fix that takes the window's counts."""
    report, truth = _loop(_model(models, family), "num_items")
    (w,) = report.windows
    assert not report.ok and w.pattern == NAMED and w.patterns == (NAMED,), report
    assert w.statistic_share is not None and w.statistic_share > 0.99, report
    assert all(abs(x - 1) < 1e-4 for x in w.weights), report  # the cross-entropy is exact
    assert "window.stats" in w.diagnosis and "fb.moe.load_balancing" in w.diagnosis
    assert truth > 1e-3 and abs(w.error - truth) <= 1e-6 * truth, (w.error, truth)


@pytest.mark.parametrize("family", ["mixtral", "olmoe"])
def test_window_stats_accumulator_is_right(models: dict[str, Any], family: str) -> None:
    """fb.Accumulator with window.stats and fb.moe: right under the inferred objective, and
    the step is the full batch's (float64 truth)."""
    report, truth = _loop(_model(models, family), "exact")
    (w,) = report.windows
    assert report.ok and w.pattern == "right" and w.objective == MOE, report
    assert w.statistic_share == 0.0 and "router aux loss" in w.objective_source, report
    assert truth < 1e-6, truth


def test_aux_off_is_plain_causal_lm(models: dict[str, Any]) -> None:
    """``output_router_logits=False`` or ``router_aux_loss_coef=0``: transformers adds no aux
    loss, so the probe judges the cross-entropy alone: the exact loop right, loss/GA a mean of
    per-micro-batch means and no statistic."""
    for config in ({"output_router_logits": False}, {"router_aux_loss_coef": 0.0}):
        report, truth = _loop(_model(models, "mixtral", **config), "exact")
        (w,) = report.windows
        assert report.ok and w.objective == "causal_lm" and w.statistic_share is None, report
        assert truth < 1e-6, truth
    report, _ = _loop(_model(models, "mixtral", router_aux_loss_coef=0.0), "loss/GA")
    (w,) = report.windows
    assert w.patterns == ("mean of per-micro-batch means",) and w.statistic_share is None


def test_declared_objectives(models: dict[str, Any]) -> None:
    """``objective="causal_lm"`` declares the aux off (the exact MoE loop then trains another
    loss); ``"causal_lm+moe"`` declared is the inferred one, and refused on a model that adds
    no aux loss, naming the config."""
    report, _ = _loop(_model(models, "mixtral"), "exact", objective="causal_lm")
    (w,) = report.windows
    assert not report.ok and w.objective == "causal_lm" and w.statistic_share is None, report
    report, _ = _loop(_model(models, "mixtral"), "exact", objective=MOE)
    assert report.ok and report.windows[0].objective_source == "declared", report
    with pytest.raises(ValueError, match=r"adds no router aux loss.*output_router_logits"):
        _loop(_model(models, "mixtral", output_router_logits=False), "exact", objective=MOE)


def _trainer(model: Any, exact: bool) -> tuple[Any, float]:
    """One window of the Hugging Face Trainer (2 rows a micro-batch, 3 micro-batches)."""
    from transformers import Trainer

    from _hf_cases import training_args

    rows = _rows()
    want, _ = reference(copy.deepcopy(model), rows)
    data = [{k: v[i] for k, v in rows.items()} for i in range(len(LENGTHS))]
    before = [p.detach().clone() for p in model.parameters()]
    with tempfile.TemporaryDirectory() as tmp:
        args = training_args(tmp, k=3, batch=2, max_steps=1, learning_rate=1.0)
        kwargs: dict[str, Any] = dict(
            model=model, args=args, train_dataset=data,
            data_collator=lambda b: {k: torch.stack([r[k] for r in b]) for k in b[0]},
            optimizers=(torch.optim.SGD(model.parameters(), lr=1.0), None),
        )  # fmt: skip
        if exact:
            from fullbatch.hf import ExactTrainer

            trainer: Any = ExactTrainer(**kwargs, loss="causal_lm")
        else:
            trainer = Trainer(**kwargs)
        with fb.probe(windows=1) as probe:
            trainer.train()
    return probe.report, _error(model, before, want)


def test_hf_trainer_stock_is_named_and_exact_trainer_right(models: dict[str, Any]) -> None:
    """The stock Trainer on a MoE model (its aux loss per micro-batch, undivided): named,
    with its share; ``fullbatch.hf.ExactTrainer``: right under ``causal_lm+moe`` (its
    ``loss='causal_lm'`` on a MoE model trains the load balancing over the window too)."""
    report, truth = _trainer(_model(models, "mixtral"), exact=False)
    (w,) = report.windows
    assert not report.ok and w.pattern == NAMED and w.objective == MOE, report
    assert w.statistic_share is not None and w.statistic_share >= NAMED_SHARE, report
    assert "ExactTrainer" in w.diagnosis and truth > 1e-3, (w.diagnosis, truth)
    report, truth = _trainer(_model(models, "mixtral"), exact=True)
    (w,) = report.windows
    assert report.ok and w.objective == MOE and "ExactTrainer" in w.objective_source, report
    assert truth < 1e-6, truth


SCRIPT = """
import torch
from _moe_cases import make_moe, moe_rows, split

model = make_moe("mixtral")
model.config.output_router_logits = True  # the model adds coef * load balancing to its loss
opt = torch.optim.SGD(model.parameters(), lr=0.1)
micros = split(moe_rows((7, 3, 5, 7, 2, 6), seed=3), (1, 3, 2))
for micro in micros:
    loss = model(**micro).loss / len(micros)  # the stock loop
    loss.backward()
opt.step()
print("script finished")
"""


def test_cli_names_the_statistic(tmp_path: Path) -> None:
    """``fullbatch probe --json -- python train.py`` on the stock loop: exit 1, the objective
    inferred as causal_lm+moe, the statistic named with its share, in the text and the data."""
    (tmp_path / "train.py").write_text(SCRIPT)
    tests = Path(__file__).parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests.parent / "src"), str(tests)])}
    result = subprocess.run(
        [sys.executable, "-m", "fullbatch", "probe", "--json", "out.json", "--",
         "python", "train.py"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=240,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert "(causal_lm+moe)" in result.stdout and NAMED in result.stdout, result.stdout
    data = json.loads((tmp_path / "out.json").read_text())
    assert problems(data) == []
    (window,) = data["windows"]
    assert NAMED in window["patterns"] and 0 < window["statistic_share"] < 1, window
    assert f"explains {window['statistic_share']:.0%} of the error" in window["diagnosis"]

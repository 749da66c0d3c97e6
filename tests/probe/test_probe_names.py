"""What the report names: two patterns at once (dropped micro-batches among per-micro-batch
means), a micro-batch with no counted items (no ``nan``), and fixes that name a route which
accepts the engine's configuration. Verdicts are checked against a float64 full batch."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import fullbatch as fb
from fullbatch._probe._engines import Engine
from fullbatch._probe._fixes import fix
from fullbatch._wings._deepspeed import refusal


def model_and_window(sizes: tuple[int, ...]) -> tuple[nn.Module, list[dict[str, Any]]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 24), nn.Tanh(), nn.Linear(24, 5))
    g = torch.Generator().manual_seed(2)
    micros = []
    for n in sizes:
        y = torch.randint(5, (n,), generator=g)
        micros.append({"x": torch.randn(n, 6, generator=g), "y": y})
    return model, micros


def objective(model: nn.Module, micro: dict[str, Any]) -> Any:
    return fb.cross_entropy_sum(model(micro["x"]), micro["y"])


def truth_error(start: nn.Module, micros: list[dict[str, Any]], applied: list[Any]) -> float:
    ref = copy.deepcopy(start).double()
    x = torch.cat([m["x"] for m in micros]).double()
    y = torch.cat([m["y"] for m in micros])
    F.cross_entropy(ref(x), y, ignore_index=-100).backward()
    truth = torch.cat([p.grad.flatten() for p in ref.parameters()])
    got = torch.cat([g.flatten() for g in applied]).double()
    return float((got - truth).norm() / truth.norm())


def test_dropped_micro_batches_among_means_of_means_name_both() -> None:
    """Per-micro-batch means over K, and micro-batches 2 and 3 differentiated but never
    accumulated (what DeepSpeed 0.17.0's ZeRO-2 offload does to the loop's backward passes)."""
    model, micros = model_and_window((2, 7, 3, 8))
    start = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    applied: list[Any] = []
    opt.register_step_pre_hook(
        lambda o, *_: applied.extend(p.grad.clone() for p in model.parameters())
    )
    with fb.probe(objective=objective, windows=1) as probe:
        for k, micro in enumerate(micros):
            loss = F.cross_entropy(model(micro["x"]), micro["y"]) / len(micros)
            if k in (1, 2):
                torch.autograd.grad(loss, list(model.parameters()))  # computed, then lost
            else:
                loss.backward()
        opt.step()
    assert truth_error(start, micros, applied) > 0.3
    check = probe.report.windows[0]
    assert not probe.report.ok
    assert check.patterns == ("dropped", "mean of per-micro-batch means"), check.diagnosis
    assert "micro-batch 2, micro-batch 3 ran but contributed nothing" in check.diagnosis
    assert "weigh by 1/(their item count)" in check.diagnosis


def test_a_micro_batch_without_items_prints_no_nan() -> None:
    model, micros = model_and_window((3, 4, 5))
    micros[1]["y"] = torch.full_like(micros[1]["y"], -100)  # nothing counted in it
    n = sum(int((m["y"] != -100).sum()) for m in micros)
    start = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    applied: list[Any] = []
    opt.register_step_pre_hook(
        lambda o, *_: applied.extend(p.grad.clone() for p in model.parameters())
    )
    with fb.probe(objective=objective, windows=1) as probe:
        for micro in micros:
            logits = model(micro["x"])
            (F.cross_entropy(logits, micro["y"], reduction="sum", ignore_index=-100) / n).backward()
        opt.step()
    assert truth_error(start, micros, applied) < 1e-6  # right
    text = str(probe.report)
    assert probe.report.ok, text
    assert "nan" not in text.lower()
    assert "micro-batch 2: no items" in text
    assert probe.report.windows[0].counts == (3.0, 0.0, 5.0)


def test_fix_on_a_configuration_fullbatch_refuses_names_no_route_that_refuses_it() -> None:
    """DeepSpeed 0.17.0's ZeRO-2 offload: ExactEngine and ExactTrainer refuse it, so the fix
    says what they accept (the version gate's own words), never to use them."""
    why = refusal(stage=2, offload=True, micro_batches=4, version="0.17.0")
    assert why is not None
    engine = Engine("DeepSpeed", package="deepspeed")
    for pattern in ("dropped", "mean of per-micro-batch means", "other"):
        text = fix(pattern, engine, why)
        assert "upgrade deepspeed" in text and "ZeRO-1 or ZeRO-3 offload" in text, text
        assert "ExactEngine" not in text and "ExactTrainer" not in text
    assert "ExactEngine" in fix("dropped", engine, None)  # where they accept it
    assert refusal(stage=2, offload=True, micro_batches=4, version="0.19.8") is None

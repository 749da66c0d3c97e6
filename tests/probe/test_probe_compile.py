"""The probe on compiled models: ``torch.compile(model)`` (an ``OptimizedModule`` around the
model) and ``model.compile()`` (the module's whole call compiled, forward hooks included, so
the probe's hooks must run eagerly, outside the graph). A probed run stays bitwise the
unprobed one, dropout included; a mean of per-micro-batch means is flagged with the error a
plain full batch measures; a right loop passes. ``backend="aot_eager"``: dynamo traces the
call as it does for inductor, without compiling kernels."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import fullbatch as fb
from _probe_cases import (
    accumulate,
    applied,
    full_batch_grad,
    make_net,
    micro_batches,
    objective,
    rel_error,
    train,
)

# torch's own note that global hooks also fire on the OptimizedModule
pytestmark = pytest.mark.filterwarnings(r"ignore:Using `torch\.compile\(module\)`:UserWarning")
STYLES = ["torch.compile(model)", "model.compile()"]
WINDOWS = [micro_batches((2, 3, 4), seed=s) for s in range(3)]


def _compiled(net: nn.Module, style: str) -> Any:
    if style == "model.compile()":
        net.compile(backend="aot_eager")
        return net
    return torch.compile(net, backend="aot_eager")


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("style", STYLES)
def test_a_probed_compiled_run_is_bitwise_the_unprobed_run(style: str) -> None:
    def run(probe: bool) -> tuple[dict[str, torch.Tensor], Any]:
        net = make_net(dropout=0.3).train()
        model = _compiled(net, style)
        torch.manual_seed(7)
        report = None
        if probe:
            with fb.probe(objective=objective, windows=2) as p:
                train(model, WINDOWS, "mean/K")
            report = p.report
        else:
            train(model, WINDOWS, "mean/K")
        return {k: v.clone() for k, v in net.state_dict().items()}, report

    plain, _ = run(False)
    probed, report = run(True)
    assert [w.pattern for w in report.windows] == ["mean of per-micro-batch means"] * 2
    for name in plain:
        assert torch.equal(plain[name], probed[name]), name


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("how", ["global", "mean/K"])
def test_a_compiled_model_is_judged_against_the_full_batch(style: str, how: str) -> None:
    window = WINDOWS[0]
    net = make_net()
    reference = full_batch_grad(net, window)  # eager, before compiling
    model = _compiled(net, style)
    with fb.probe(objective=objective) as p:
        accumulate(model, window, how)
        measured = rel_error(applied(net), reference)
        torch.optim.SGD(net.parameters(), lr=0.1).step()
    result = p.report.windows[0]
    if how == "global":
        assert measured < 1e-12 and p.report.ok and result.pattern == "right", str(p.report)
    else:
        assert measured > 1e-2 and not p.report.ok
        assert result.pattern == "mean of per-micro-batch means", str(p.report)
        assert result.error == pytest.approx(measured, rel=1e-6)


@pytest.mark.parametrize("style", STYLES)
def test_a_compiled_model_called_with_a_tensor(style: str) -> None:
    """``out = model(x)`` with the labels beside it (dynamo once failed to trace the probe's
    hook over a tuple of positional tensors: the hooks now run outside the graph)."""
    window = WINDOWS[1]
    net = make_net()
    reference = full_batch_grad(net, window)
    model = _compiled(net, style)
    total = sum(int((m["labels"] != -100).sum()) for m in window)
    with fb.probe(objective="sample") as p:
        for x, labels in [(m["x"], m["labels"]) for m in window]:
            loss_sum, _ = fb.cross_entropy_sum(model(x), labels)
            (loss_sum / total).backward()
        measured = rel_error(applied(net), reference)
        torch.optim.SGD(net.parameters(), lr=0.1).step()
    assert measured < 1e-12 and p.report.ok, str(p.report)
    assert p.report.windows[0].pattern == "right"

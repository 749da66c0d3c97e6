"""``fb.probe`` around ``trainer.fit()``: Lightning's ``accumulate_grad_batches`` with a mean
loss is flagged, ``fullbatch.lightning.ExactAccumulation`` passes. Lightning runs a window's
last micro-batch inside ``optimizer.step(closure)``; the probe checks after the closure. Both
are judged against a plain full-batch gradient computed here from the first window."""

from __future__ import annotations

import copy
import tempfile
from typing import Any

import pytest
import torch

import fullbatch as fb

pytest.importorskip("lightning.pytorch")
from _lightning_cases import LM, fit, make_rows, micro_batches, pad, tiny_lm

K = 4
SIZES = [1, 3, 2, 2, 3, 1, 2, 2]  # rows per micro-batch: two windows of uneven tokens


def _run(*, exact: bool, **trainer_kwargs: Any) -> dict[str, Any]:
    import lightning.pytorch as pl

    first: dict[str, Any] = {}

    class Applied(pl.Callback):  # after ExactAccumulation's normalization (registered first)
        def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
            if "grads" not in first:
                first["grads"] = [p.grad.clone() for p in module.net.parameters()]

    rows = make_rows(sum(SIZES), seed=5)
    batches = micro_batches(rows, SIZES)
    net = tiny_lm().double()
    start = copy.deepcopy(net)
    module = LM(net, mean=not exact)
    with tempfile.TemporaryDirectory() as tmp, fb.probe(objective="causal_lm") as probe:
        fit(module, batches, k=K, root=tmp, exact=exact, callbacks=[Applied()], **trainer_kwargs)
    return {"report": probe.report, "grads": first["grads"], "start": start, "rows": rows}


def _reference(start: torch.nn.Module, rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """The first window's rows padded into one batch, the mean token loss, one backward."""
    full = pad(rows[: sum(SIZES[:K])])
    logits = start(full["input_ids"])[:, :-1]
    labels = full["labels"][:, 1:]
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100
    )
    loss.backward()
    return [p.grad.clone() for p in start.parameters()]


def _rel(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    diff = sum(float((g - r).pow(2).sum()) for g, r in zip(got, ref, strict=True))
    return (diff / sum(float(r.pow(2).sum()) for r in ref)) ** 0.5


def test_stock_accumulate_grad_batches_with_a_mean_loss_is_flagged() -> None:
    run = _run(exact=False)
    check = run["report"].windows[0]  # the first of the windows checked
    assert not run["report"].ok and check.engine == "Lightning"
    assert check.pattern == "mean of per-micro-batch means" and check.micro_batches == K
    assert "fullbatch.lightning.ExactAccumulation" in check.diagnosis
    assert check.error == pytest.approx(_rel(run["grads"], _reference(run["start"], run["rows"])))


def test_exact_accumulation_passes() -> None:
    run = _run(exact=True)
    assert run["report"].ok, str(run["report"])
    check = run["report"].windows[0]  # the first of the windows checked
    assert check.engine == "fullbatch.lightning.ExactAccumulation" and check.micro_batches == K
    assert _rel(run["grads"], _reference(run["start"], run["rows"])) < 1e-12


def test_exact_accumulation_with_gradient_clipping() -> None:
    run = _run(exact=True, gradient_clip_val=1e-3)
    check = run["report"].windows[0]  # the first of the windows checked
    assert run["report"].ok, str(run["report"])
    assert check.clip is not None and check.clip[0] == 1e-3
    ref = _reference(run["start"], run["rows"])
    norm = sum(float(r.pow(2).sum()) for r in ref) ** 0.5
    assert check.clip[1] == pytest.approx(norm, rel=1e-9)  # the clip saw the full batch's norm
    assert _rel(run["grads"], ref) < 1e-12  # Lightning calls on_before_optimizer_step pre-clip

"""The step the user asked for, beyond the accumulation: a clip run on gradients a GradScaler
still scales, and a clip configured in one place but applied from another. Each case is
measured here against a plain float64 full-batch step written in the test (rows
concatenated, a mean cross-entropy, the clip the user asked for, one SGD step)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fullbatch as fb

Micro = dict[str, torch.Tensor]


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 5))


def window(sizes: Sequence[int] = (3, 5, 2, 6)) -> list[Micro]:
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(n, 12, generator=g), "y": torch.randint(5, (n,), generator=g)}
            for n in sizes]  # fmt: skip


def objective(model: nn.Module, micro: Micro) -> tuple[torch.Tensor, torch.Tensor]:
    return fb.cross_entropy_sum(model(micro["x"]), micro["y"])


def truth_update(model: nn.Module, micros: list[Micro], max_norm: float) -> torch.Tensor:
    """The float64 full-batch update of SGD(lr=1): -clip(∇ mean loss, max_norm)."""
    ref = copy.deepcopy(model).double()
    x = torch.cat([m["x"] for m in micros]).double()
    y = torch.cat([m["y"] for m in micros])
    F.cross_entropy(ref(x), y).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    return -torch.cat([p.grad.flatten() for p in ref.parameters()])


def amp_run(unscale_first: bool, max_norm: float = 1.0) -> tuple[float, fb.probe]:
    """A GradScaler loop (fp16's loss scale 2^16), clipping before or after unscale_; returns
    the update's error against the float64 truth and the probe."""
    model, micros = mlp(), window()
    truth = truth_update(model, micros, max_norm)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()]).double()
    n = sum(len(m["y"]) for m in micros)
    with fb.probe(objective=objective, windows=1) as probe:
        for micro in micros:
            loss = F.cross_entropy(model(micro["x"]), micro["y"], reduction="sum") / n
            scaler.scale(loss).backward()
        if unscale_first:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(opt)
        scaler.update()
    after = torch.cat([p.detach().flatten() for p in model.parameters()]).double()
    error = float((after - before - truth).norm() / truth.norm())
    return error, probe


def test_clip_before_unscale_is_a_scaled_clip() -> None:
    error, probe = amp_run(unscale_first=False)
    assert error > 0.99  # every update is ~1/65536 of the truth's
    check = probe.report.windows[0]
    assert not probe.report.ok and check.pattern == "scaled clip", check.diagnosis
    assert "the clip's input norm is 2^16 x the gradient's" in check.diagnosis
    assert "scaler.unscale_(optimizer)" in check.diagnosis
    assert check.patterns == ("scaled clip",)


def test_clip_after_unscale_is_right() -> None:
    error, probe = amp_run(unscale_first=True)
    assert error < 1e-5
    assert probe.report.ok, str(probe.report)


def test_clip_after_unscale_that_clips_is_right() -> None:
    error, probe = amp_run(unscale_first=True, max_norm=0.05)
    assert error < 1e-5
    check = probe.report.windows[0]
    assert probe.report.ok and check.clip is not None, str(probe.report)
    assert "clip_grad_norm_(max_norm=0.05) saw norm" in str(check)


def test_lightning_clip_other_than_gradient_clip_val_is_named() -> None:
    """Lightning with ``gradient_clip_val=1e-3`` whose module's ``configure_gradient_clipping``
    clips at 1.0 instead (the accumulation itself right: each micro-batch's loss sum times
    K / N, Lightning divides by K). The truth: the update against SGD's step on the float64
    full-batch gradient clipped at 1e-3, as the Trainer was asked."""
    pytest.importorskip("lightning.pytorch")
    import tempfile

    from _lightning_cases import LM, fit, make_rows, micro_batches, pad, tiny_lm

    k, sizes = 4, [1, 3, 2, 2]
    rows = make_rows(sum(sizes), seed=5)
    batches = micro_batches(rows, sizes)
    count = float(sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches))

    class ClipsAtOne(LM):
        def configure_gradient_clipping(self, optimizer: Any, *_: Any, **__: Any) -> None:
            torch.nn.utils.clip_grad_norm_(self.parameters(), 1.0)  # not the Trainer's value

    net = tiny_lm().double()
    start = copy.deepcopy(net)
    module = ClipsAtOne(net, step_output=lambda loss_sum, n: loss_sum * k / count)
    with tempfile.TemporaryDirectory() as tmp, fb.probe(objective="causal_lm") as probe:
        rec = fit(module, batches, k=k, root=tmp, exact=False, gradient_clip_val=1e-3)
    ref = copy.deepcopy(start)
    full = pad(rows)
    logits = ref(full["input_ids"])[:, :-1]
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), full["labels"][:, 1:].reshape(-1),
                    ignore_index=-100).backward()  # fmt: skip
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3)
    asked = torch.cat([-0.1 * p.grad.flatten() for p in ref.parameters()])
    moved = torch.cat([(a - b).flatten() for a, b in zip(rec.params[0], start.parameters(),
                                                         strict=True)])  # fmt: skip
    assert float((moved - asked).norm() / asked.norm()) > 1.0  # far from the step asked for
    check = probe.report.windows[0]
    assert not probe.report.ok and check.pattern == "clip differs", str(probe.report)
    assert check.error < 1e-10  # the accumulation itself is right
    assert "Trainer(gradient_clip_val=0.001)=0.001" in check.diagnosis
    assert "clip_grad_norm_(max_norm=1)" in check.diagnosis

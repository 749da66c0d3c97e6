"""Two forwards of one micro-batch (an encoder called on ``q`` and on ``k`` in one iteration)
are one micro-batch of a callable objective; a loss that couples a micro-batch's rows
(in-batch negatives) is named and never judged right per micro-batch. Each case is checked
against the float64 full batch of the same loss written here."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import fullbatch as fb

SIZES = (3, 5, 4, 6)


def encoder() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))


def pairs() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(4)
    out = []
    for n in SIZES:
        q = torch.randn(n, 8, generator=g)
        out.append({"q": q, "k": q + 0.1 * torch.randn(n, 8, generator=g)})
    return out


def info_nce(model: nn.Module, micro: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """InfoNCE with in-batch negatives: each q against every k of its micro-batch, summed."""
    zq, zk = F.normalize(model(micro["q"]), dim=-1), F.normalize(model(micro["k"]), dim=-1)
    logits = zq @ zk.T / 0.1
    return F.cross_entropy(logits, torch.arange(len(zq)), reduction="sum"), len(zq)


def aligned(model: nn.Module, micro: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """A per-pair loss (no negatives): separable over rows."""
    return (model(micro["q"]) - model(micro["k"])).pow(2).sum(), len(micro["q"])


def run(loss_fn: Any) -> tuple[float, Any]:
    """The loop every contrastive tutorial writes: two encoder calls per micro-batch, the
    micro-batch's own loss over its rows, divided by the window's rows. The update's error
    against the float64 full batch of ``loss_fn`` over the window's rows, and the probe."""
    model, micros = encoder(), pairs()
    ref = copy.deepcopy(model).double()
    whole = {key: torch.cat([m[key] for m in micros]).double() for key in ("q", "k")}
    total, n = loss_fn(ref, whole)
    (total / n).backward()
    truth = torch.cat([p.grad.flatten() for p in ref.parameters()])
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()]).double()
    with fb.probe(objective=loss_fn, windows=1) as probe:
        for batch in micros:
            loss, _ = loss_fn(model, batch)
            (loss / sum(SIZES)).backward()
        opt.step()
    after = torch.cat([p.detach().flatten() for p in model.parameters()]).double()
    return float((before - after - truth).norm() / truth.norm()), probe


def test_two_forwards_of_one_micro_batch_are_one_micro_batch() -> None:
    error, probe = run(aligned)
    assert error < 1e-4  # separable: the full batch's, to float32 rounding of a difference
    check = probe.report.windows[0]
    assert probe.report.ok, str(probe.report)
    assert check.micro_batches == len(SIZES) and check.counts == tuple(map(float, SIZES))
    assert max(check.precision) < 1e-3  # a regular fit, not a singular one


def test_in_batch_negatives_are_a_coupled_loss_never_right() -> None:
    error, probe = run(info_nce)
    assert error > 0.3  # the full batch's InfoNCE has every row's negatives: far off
    check = probe.report.windows[0]
    assert not probe.report.ok and check.pattern == "coupled loss", str(probe.report)
    assert "cannot judge a coupled loss per micro-batch" in check.diagnosis
    assert "window.run_coupled" in check.diagnosis

"""Several optimizers stepped together end one window: every optimizer's parameters are checked,
and a mistake confined to one of them is named with that optimizer and its parameters.

The script splits a model's parameters between two optimizers (a body and a head; or matrices
to one and the rest to another, as Muon + AdamW setups do) and steps both after every K
micro-batches; the applied gradients are checked here against a plain float64 full batch.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fullbatch as fb

K = 4
F64 = torch.float64


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 16)
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


def _loader() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 6, generator=g, dtype=F64), torch.randint(5, (n,), generator=g))
            for n in (2, 3, 4, 1, 3, 2, 2, 4)]  # fmt: skip


def _full_batch(model: nn.Module, rows) -> dict[str, torch.Tensor]:
    """The plain reference: the window's rows as one batch, PyTorch's mean loss, one backward."""
    ref = copy.deepcopy(model)
    x, y = torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])
    F.cross_entropy(ref(x), y).backward()
    return {n: p.grad.clone() for n, p in ref.named_parameters()}


def _rel(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    diff = sum(float((g - r).pow(2).sum()) for g, r in zip(got, ref, strict=True))
    return (diff / sum(float(r.pow(2).sum()) for r in ref)) ** 0.5


def _train(*, split: str, unscale_head: bool, windows: object = None):
    """Two optimizers over the body and the head (``split="body/head"``) or over the matrices
    and the rest (``"matrices/rest"``); a static loss scale of 2 undone on the gradients before
    the steps, on every parameter (right) or not on the head's (left x2)."""
    torch.manual_seed(0)
    model = Net().to(F64)
    if split == "body/head":
        first, second = list(model.body.parameters()), list(model.head.parameters())
    else:
        first = [p for p in model.parameters() if p.ndim == 2]
        second = [p for p in model.parameters() if p.ndim < 2]
    opt_first = torch.optim.SGD(first, lr=0.1, momentum=0.9)
    opt_second = torch.optim.Adam(second, lr=1e-3)
    head = {id(p) for p in model.head.parameters()}
    loader = _loader()
    windows_rows = [loader[i : i + K] for i in range(0, len(loader), K)]
    measured: list[dict[str, float]] = []
    scale = 2.0
    with fb.probe(objective="sample", windows=windows) as probe:
        for i, (x, y) in enumerate(loader):
            rows = sum(len(t) for _, t in windows_rows[i // K])
            loss = F.cross_entropy(model(x), y, reduction="sum") / rows
            (loss * scale).backward()
            if (i + 1) % K == 0:
                for p in model.parameters():
                    if unscale_head or id(p) not in head:
                        p.grad /= scale
                ref = _full_batch(model, windows_rows[i // K])
                grads = dict(model.named_parameters())
                measured.append({n: _rel([grads[n].grad], [ref[n]]) for n in ref})
                opt_first.step()
                opt_second.step()
                opt_first.zero_grad()
                opt_second.zero_grad()
    return probe.report, measured


def test_one_optimizers_gradient_doubled_is_flagged_and_named() -> None:
    report, measured = _train(split="body/head", unscale_head=False, windows=1)
    assert measured[0]["head.weight"] == pytest.approx(1.0, rel=1e-9)  # x2, measured here
    assert measured[0]["head.bias"] == pytest.approx(1.0, rel=1e-9)
    assert measured[0]["body.weight"] < 1e-12 and measured[0]["body.bias"] < 1e-12
    (check,) = report.windows
    assert not report.ok and not check.ok, str(report)
    assert check.micro_batches == K
    assert "optimizer 2 (Adam: head.weight, head.bias)" in check.diagnosis
    assert "x2" in check.diagnosis and "body.weight" not in check.diagnosis
    assert "the parameters of optimizer 1 are right" in check.diagnosis
    assert any("optimizer 1 (SGD" in line and "right" in line for line in check.optimizers)
    assert any("optimizer 2 (Adam" in line and "WRONG" in line for line in check.optimizers)


@pytest.mark.parametrize("split", ["body/head", "matrices/rest"])
def test_two_right_optimizers_are_one_window_each_step(split: str) -> None:
    report, measured = _train(split=split, unscale_head=True, windows=2)
    assert all(v < 1e-12 for m in measured for v in m.values())  # right, measured here
    assert report.ok, str(report)
    assert [w.step for w in report.windows] == [1, 2]
    assert [w.micro_batches for w in report.windows] == [K, K]  # never "0 micro-batches"
    for check in report.windows:
        assert len(check.optimizers) == 2 and all("right" in line for line in check.optimizers)
        assert check.error < 1e-12


def test_an_optimizer_over_part_of_the_model_is_checked_on_its_parameters() -> None:
    """Fine-tuning the head alone, the body left trainable but in no optimizer: each window
    is checked on the head's parameters (it closes at the next step, or when the block ends),
    and a wrong head is still named."""
    for divisor, right in ((1.0, True), (4.0, False)):
        torch.manual_seed(0)
        model = Net().to(F64)
        opt = torch.optim.SGD(model.head.parameters(), lr=0.1)
        loader = _loader()
        windows_rows = [loader[i : i + K] for i in range(0, len(loader), K)]
        errors = []
        with fb.probe(objective="sample", windows=2) as probe:
            for i, (x, y) in enumerate(loader):
                rows = sum(len(t) for _, t in windows_rows[i // K])
                (F.cross_entropy(model(x), y, reduction="sum") / rows / divisor).backward()
                if (i + 1) % K == 0:
                    ref = _full_batch(model, windows_rows[i // K])
                    grads = [model.head.weight.grad, model.head.bias.grad]
                    errors.append(_rel(grads, [ref["head.weight"], ref["head.bias"]]))
                    opt.step()
                    model.zero_grad()
        assert (max(errors) < 1e-12) == right
        assert [w.step for w in probe.report.windows] == [1, 2]
        assert probe.report.ok == right, str(probe.report)
        if not right:
            assert probe.report.windows[0].factor == pytest.approx(0.25, rel=1e-6)

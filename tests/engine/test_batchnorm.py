"""BatchNorm under accumulation: a warning by default; ``batchnorm="window"`` gives running
statistics equal to one full-batch forward in train mode (float64)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fullbatch as fb

F64 = torch.float64


class BNMLP(nn.Module):
    def __init__(self, momentum: float | None) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.bn = nn.BatchNorm1d(6, momentum=momentum)
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.bn(self.inp(x))))


class BNConv(nn.Module):
    """Two BatchNorm layers side by side (not stacked), one without affine parameters."""

    def __init__(self, momentum: float | None, stacked: bool = False) -> None:
        super().__init__()
        self.stacked = stacked
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.bn = nn.BatchNorm2d(3, momentum=momentum)
        self.conv2 = nn.Conv2d(3 if stacked else 2, 4, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(4, momentum=momentum, affine=False)
        self.head = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.conv(x)))
        h2 = torch.relu(self.bn2(self.conv2(h if self.stacked else x)))
        return self.head(torch.cat([h, h2], dim=1).mean(dim=(2, 3)))


def make(kind: str, momentum: float | None) -> nn.Module:
    torch.manual_seed(0)
    if kind == "stacked":
        return BNConv(momentum, stacked=True).to(F64)
    return (BNMLP if kind == "mlp" else BNConv)(momentum).to(F64)


def windows(kind: str, n: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    shape = (10, 4) if kind == "mlp" else (7, 2, 5, 5)
    out = []
    for i in range(n):
        x = torch.randn(*shape, generator=g, dtype=F64) * (1 + i) + i  # statistics move
        y = torch.randint(0, 3, (shape[0],), generator=g)
        out.append({"x": x, "y": y})
    return out


def buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.named_buffers()}


def test_batchnorm_without_option_warns() -> None:
    model = make("mlp", 0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match=r"BatchNorm.*bn.*batchnorm='window'"):
        fb.Accumulator(model, opt, micro_batch_size=4)


def test_window_option_keeps_warning_that_the_gradient_is_not_exact() -> None:
    """batchnorm='window' fixes running statistics only: the gradient warning stays."""
    model = make("mlp", 0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match=r"gradient is NOT the full batch's") as caught:
        fb.Accumulator(model, opt, micro_batch_size=4, batchnorm="window").close()
    text = str(caught[0].message)
    assert "not pass through another train-mode BatchNorm" in text
    assert "the stem alone" in text


def test_no_warning_in_eval_mode() -> None:
    model = make("mlp", 0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fb.Accumulator(model, opt, micro_batch_size=4).close()
        fb.Accumulator(model, opt, micro_batch_size=4, batchnorm="window").close()


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("kind,size", [("mlp", 4), ("mlp", 5), ("conv", 3), ("conv", 1)])
def test_window_running_stats_equal_one_full_batch_forward(kind, size, momentum) -> None:
    data = windows(kind, 3)
    model = make(kind, momentum)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    checked = 0
    with fb.Accumulator(model, opt, micro_batch_size=size, batchnorm="window") as acc:
        for window in acc.windows(data):
            # the reference: a fresh copy (no fullbatch hooks) of the model at window start,
            # one full-batch forward in train mode
            ref = make(kind, momentum)
            ref.load_state_dict(model.state_dict())
            ref.train()
            with torch.no_grad():
                ref(data[window.index]["x"])
            for micro in window:
                loss_sum, n = fb.cross_entropy_sum(model(micro["x"]), micro["y"])
                window.backward(loss_sum, n)
            stats = window.step()
            assert not stats.skipped
            got, want = buffers(model), buffers(ref)
            assert got.keys() == want.keys()
            for key in want:
                if key.endswith("num_batches_tracked"):
                    assert int(got[key]) == int(want[key]) == window.index + 1, key
                else:
                    torch.testing.assert_close(got[key], want[key], rtol=1e-12, atol=1e-14)
            checked += 1
    assert checked == 3


def test_without_window_option_running_stats_differ() -> None:
    """What batchnorm='window' fixes: per-micro-batch updates give other statistics."""
    data = windows("mlp", 1)
    model = make("mlp", 0.1)
    ref = make("mlp", 0.1)
    with torch.no_grad():
        ref(data[0]["x"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning), fb.Accumulator(model, opt, micro_batch_size=4) as acc:
        for window in acc.windows(data):
            for micro in window:
                window.backward(*fb.cross_entropy_sum(model(micro["x"]), micro["y"]))
            window.step()
    assert int(model.bn.num_batches_tracked) == 3
    assert not torch.allclose(model.bn.running_mean, ref.bn.running_mean)


def test_stacked_batchnorm_first_layer_exact() -> None:
    """A BatchNorm fed by another train-mode BatchNorm sees micro-batch-normalized inputs, so
    only the first layer's running statistics can equal the full batch's (a known limit)."""
    data = windows("stacked", 1)
    model = make("stacked", 0.1)
    ref = make("stacked", 0.1)
    with torch.no_grad():
        ref(data[0]["x"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with fb.Accumulator(model, opt, micro_batch_size=3, batchnorm="window") as acc:
        for window in acc.windows(data):
            for micro in window:
                window.backward(*fb.cross_entropy_sum(model(micro["x"]), micro["y"]))
            window.step()
    torch.testing.assert_close(model.bn.running_mean, ref.bn.running_mean, rtol=1e-12, atol=0)
    torch.testing.assert_close(model.bn.running_var, ref.bn.running_var, rtol=1e-12, atol=0)
    assert int(model.bn2.num_batches_tracked) == 1


def test_skipped_and_discarded_windows_leave_running_stats() -> None:
    data = windows("mlp", 3)
    data[1]["y"][:] = -100  # zero counted items: skipped
    model = make("mlp", 0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    history = []
    with fb.Accumulator(model, opt, micro_batch_size=5, batchnorm="window") as acc:
        for window in acc.windows(data):
            start = buffers(model)
            for micro in window:
                window.backward(*fb.cross_entropy_sum(model(micro["x"]), micro["y"]))
            if window.index == 2:
                window.discard()
                stats = None
            else:
                stats = window.step()
            history.append((start, buffers(model), stats))
    for index in (1, 2):
        start, end, _ = history[index]
        for key in start:
            assert torch.equal(start[key], end[key]), (index, key)
    assert history[1][2].skipped


def test_eval_forward_inside_a_window_is_not_recorded() -> None:
    data = windows("mlp", 1)
    model = make("mlp", None)
    ref = make("mlp", None)
    with torch.no_grad():
        ref(data[0]["x"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with fb.Accumulator(model, opt, micro_batch_size=5, batchnorm="window") as acc:
        for window in acc.windows(data):
            for micro in window:
                with torch.no_grad():  # e.g. a metric computed on the side
                    model(micro["x"] * 100)
                window.backward(*fb.cross_entropy_sum(model(micro["x"]), micro["y"]))
            window.step()
    torch.testing.assert_close(model.bn.running_mean, ref.bn.running_mean, rtol=1e-12, atol=0)
    torch.testing.assert_close(model.bn.running_var, ref.bn.running_var, rtol=1e-12, atol=0)


def test_close_removes_hooks() -> None:
    model = make("conv", 0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = fb.Accumulator(model, opt, micro_batch_size=2, batchnorm="window")
    assert model.bn._forward_pre_hooks
    acc.close()
    assert not model.bn._forward_pre_hooks and not model.bn2._forward_pre_hooks
    # the model still trains in plain PyTorch afterwards, with torch's own BN updates
    before = model.bn.num_batches_tracked.clone()
    F.cross_entropy(model(windows("conv", 1)[0]["x"]), torch.zeros(7, dtype=torch.long))
    assert int(model.bn.num_batches_tracked) == int(before) + 1


def _skipping_loss(reason: str, model: nn.Module, micro: dict) -> tuple[torch.Tensor, int]:
    loss_sum, n = fb.cross_entropy_sum(model(micro["x"]), micro["y"])
    if reason == "non-finite loss":
        return loss_sum + math.inf, n
    if reason == "non-finite gradient":  # the value stays finite: sqrt(0) = 0, d/dw = inf
        w = model.out.weight
        return loss_sum + torch.sqrt(w - w.detach()).sum(), n
    return loss_sum, n


@pytest.mark.parametrize(
    "reason", ["no items counted in the window", "non-finite loss", "non-finite gradient"]
)
def test_each_skip_reason_leaves_running_stats_and_the_next_window_exact(reason: str) -> None:
    """A skipped window leaves every BatchNorm buffer (num_batches_tracked too) bit for bit as
    before it, and the next window's update is as if the skipped one never ran."""
    data = windows("mlp", 3)
    if reason.startswith("no items"):
        data[1]["y"][:] = -100
    model = make("mlp", 0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the two runs see equal weights
    history = []
    with fb.Accumulator(model, opt, micro_batch_size=4, batchnorm="window") as acc:
        for window in acc.windows(data):
            start = buffers(model)
            for micro in window:
                if window.index == 1:
                    window.backward(*_skipping_loss(reason, model, micro))
                else:
                    window.backward(*fb.cross_entropy_sum(model(micro["x"]), micro["y"]))
            with pytest.warns(RuntimeWarning) if window.index == 1 else warnings.catch_warnings():
                stats = window.step()
            history.append((start, buffers(model), stats))
    start, end, stats = history[1]
    assert stats.skipped and stats.reason == reason
    assert start.keys() == end.keys()
    for key in start:
        assert torch.equal(start[key], end[key]), key
    # the same model trained on windows 0 and 2 only
    ref = make("mlp", 0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.0)
    with fb.Accumulator(ref, ref_opt, micro_batch_size=4, batchnorm="window") as acc:
        for window in acc.windows([data[0], data[2]]):
            for micro in window:
                window.backward(*fb.cross_entropy_sum(ref(micro["x"]), micro["y"]))
            window.step()
    got, want = buffers(model), buffers(ref)
    for key in want:
        assert torch.equal(got[key], want[key]), key
    assert int(model.bn.num_batches_tracked) == 2

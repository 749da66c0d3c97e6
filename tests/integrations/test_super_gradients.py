"""``fullbatch.super_gradients``: Super-Gradients' Trainer, each step the full batch's.

CI cannot install Super-Gradients, so these tests run ``ExactTrainer`` and ``SummedLoss`` on a
stand-in for SG 3.7.1's Trainer and callbacks (``tests/_super_gradients_standin.py``, which
says what it follows). With ``FULLBATCH_TEST_SG=real`` the same tests run on an installed
Super-Gradients instead (the stand-in-only ones skip), which is how the stand-in was checked;
``benchmarks/super_gradients_exact.py`` measures the real one beside the stock route.

The reference is plain PyTorch in float64: each window's images as one batch, the pixel-mean
cross-entropy with ``ignore_index`` pixels left out, one SGD step.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
import types
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fullbatch
import fullbatch as fb
from _super_gradients_standin import modules as standin_modules

REAL = os.environ.get("FULLBATCH_TEST_SG") == "real"
CLASSES, SIDE, PER_MICRO, LR = 3, 4, 2, 0.5


class PixelNet(nn.Module):
    """Per-pixel classes, class-last logits ``[B, H, W, C]``; optionally a BatchNorm first."""

    def __init__(self, batchnorm: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bn = nn.BatchNorm2d(3) if batchnorm else nn.Identity()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.head = nn.Conv2d(6, CLASSES, 1)
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.conv(self.bn(x)))).movedim(1, -1)


class PixelMeanLoss(nn.Module):
    """What an SG loss returns: the micro-batch's mean over its counted pixels."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, CLASSES), targets.reshape(-1), ignore_index=-100)


def pixel_sum(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return fb.cross_entropy_sum(logits, targets, ignore_index=-100)


@pytest.fixture
def sg(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``fullbatch.super_gradients`` imported on the stand-in (or the real SG), and the stock
    ``Trainer``; the module is forgotten afterwards."""
    if REAL:
        pytest.importorskip("super_gradients")
    else:
        for name, module in standin_modules().items():
            monkeypatch.setitem(sys.modules, name, module)
    sys.modules.pop("fullbatch.super_gradients", None)
    module = importlib.import_module("fullbatch.super_gradients")
    yield types.SimpleNamespace(
        ExactTrainer=module.ExactTrainer,
        SummedLoss=module.SummedLoss,
        Trainer=sys.modules["super_gradients.training"].Trainer,
    )
    sys.modules.pop("fullbatch.super_gradients", None)
    if "super_gradients" in vars(fullbatch):
        delattr(fullbatch, "super_gradients")


def images(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` (image, targets); image i has about 0.9 i / n of its pixels ignored (one kept)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        x = torch.randn(3, SIDE, SIDE, generator=g, dtype=torch.float64)
        y = torch.randint(0, CLASSES, (SIDE, SIDE), generator=g)
        y[torch.rand(SIDE, SIDE, generator=g) < 0.9 * i / n] = -100
        y[0, 0] = 1
        out.append((x, y))
    return out


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def windows(n_micro: int, k: int, epochs: int) -> list[range]:
    """Micro-batch indices of each window: K at a time, the epoch's rest last."""
    return [range(s, min(s + k, n_micro)) for _ in range(epochs) for s in range(0, n_micro, k)]


def reference(
    data: list[Any], k: int, epochs: int, clip: float | None = None, skip: tuple[int, ...] = ()
) -> torch.Tensor:
    """Parameters after training every window (but ``skip``) as one full batch."""
    net = PixelNet()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for w, window in enumerate(windows(len(data) // PER_MICRO, k, epochs)):
        if w in skip:
            continue
        rows = [data[i] for m in window for i in range(m * PER_MICRO, (m + 1) * PER_MICRO)]
        x, y = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
        F.cross_entropy(net(x).reshape(-1, CLASSES), y.reshape(-1), ignore_index=-100).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return flat(net)


def train(trainer: Any, loss: nn.Module, data: list[Any], k: int, epochs: int,
          net: nn.Module | None = None, **extra: Any) -> nn.Module:  # fmt: skip
    net = PixelNet() if net is None else net
    loader = torch.utils.data.DataLoader(
        data,
        batch_size=PER_MICRO,
        collate_fn=lambda b: tuple(torch.stack(t) for t in zip(*b, strict=True)),
    )
    params = {
        "max_epochs": epochs, "lr_mode": None, "initial_lr": LR, "lr_warmup_epochs": 0,
        "warmup_mode": "LinearEpochLRWarmup", "optimizer": "SGD",
        "optimizer_params": {"momentum": 0.0, "weight_decay": 0.0}, "loss": loss,
        "batch_accumulate": k, "ema": False, "mixed_precision": False,
        "average_best_models": False, "train_metrics_list": [], "valid_metrics_list": [],
        "metric_to_watch": type(loss).__name__, "greater_metric_to_watch_is_better": False,
        "save_model": False, "run_validation_freq": 1, "silent_mode": True, **extra,
    }  # fmt: skip
    trainer.train(model=net, training_params=params, train_loader=loader, valid_loader=loader)
    return net


def error(net: nn.Module, ref: torch.Tensor) -> float:
    start = flat(PixelNet())
    return float((flat(net) - ref).norm() / (ref - start).norm())


def make(cls: Any, tmp_path: Any, **kwargs: Any) -> Any:
    return cls(experiment_name="fb", ckpt_root_dir=str(tmp_path), **kwargs)


# -- exact where the stock Trainer is not --------------------------------------------------


@pytest.mark.parametrize(
    "n_micro, epochs, clip",
    [(4, 1, None), (5, 2, None), (5, 2, 0.05)],
    ids=["one-window", "two-epochs-partial-windows", "two-epochs-clip_grad_norm"],
)
def test_every_step_is_the_full_batch(sg: Any, tmp_path: Any, n_micro: int, epochs: int,
                                      clip: float | None) -> None:  # fmt: skip
    data, k = images(n_micro * PER_MICRO), 4
    ref = reference(data, k, epochs, clip)
    trainer = make(sg.ExactTrainer, tmp_path)
    net = train(trainer, sg.SummedLoss(pixel_sum), data, k, epochs, clip_grad_norm=clip)
    assert error(net, ref) < 1e-12
    assert trainer.fb_counters.steps == len(windows(n_micro, k, epochs))
    assert all(p.grad is None for p in net.parameters())  # nothing left unapplied
    # The stock Trainer on the same run: a sum of means, windows across the epoch boundary,
    # the last partial window left in .grad.
    stock = train(make(sg.Trainer, tmp_path), PixelMeanLoss(), data, k, epochs, clip_grad_norm=clip)
    assert error(stock, ref) > 0.3
    assert any(p.grad is not None and p.grad.any() for p in stock.parameters()) == (epochs == 2)


def test_the_clip_is_active_and_sees_the_normalized_gradient(sg: Any, tmp_path: Any) -> None:
    data = images(4 * PER_MICRO)
    unclipped, clipped = reference(data, 4, 1), reference(data, 4, 1, clip=0.05)
    assert (unclipped - clipped).norm() > 0.1 * (unclipped - flat(PixelNet())).norm()
    seen: list[float] = []

    class Norm(sg_callback(sg)):  # type: ignore[misc]
        def on_train_batch_gradient_step_start(self, context: Any) -> None:
            grads = [p.grad.reshape(-1) for p in context.net.parameters()]
            seen.append(float(torch.cat(grads).norm()))

    net = train(make(sg.ExactTrainer, tmp_path), sg.SummedLoss(pixel_sum), data, 4, 1,
                clip_grad_norm=0.05, phase_callbacks=[Norm()])  # fmt: skip
    assert error(net, clipped) < 1e-12
    full = PixelNet()
    x, y = torch.stack([d[0] for d in data]), torch.stack([d[1] for d in data])
    F.cross_entropy(full(x).reshape(-1, CLASSES), y.reshape(-1), ignore_index=-100).backward()
    norm = float(torch.cat([p.grad.reshape(-1) for p in full.parameters()]).norm())
    assert seen == [pytest.approx(norm, rel=1e-12)]  # callbacks see the full-batch gradient


def sg_callback(sg: Any) -> type:
    return sys.modules["super_gradients.training.utils.callbacks"].Callback  # type: ignore[no-any-return]


# -- skipped windows -----------------------------------------------------------------------


@pytest.mark.parametrize("poison", ["nan-loss", "inf-gradient", "no-items"])
def test_a_bad_window_is_skipped_and_the_next_is_exact(sg: Any, tmp_path: Any, poison: str) -> None:
    """Each epoch's last, one-micro-batch window (windows 1 and 3) is poisoned."""
    data, net = images(5 * PER_MICRO), PixelNet()
    x, y = data[8]
    if poison == "nan-loss":
        data[8] = (x.clone().fill_(float("nan")), y)
    elif poison == "no-items":
        data[8], data[9] = (x, torch.full_like(y, -100)), (data[9][0], torch.full_like(y, -100))
    else:
        backward = iter(range(10))  # micro-batches 4 and 9 (of 0-9) get an inf gradient
        net.head.bias.register_hook(lambda g: g * math.inf if next(backward) % 5 == 4 else g)
    ends: list[int] = []
    after: list[torch.Tensor] = []  # the parameters after each micro-batch

    class Watch(sg_callback(sg)):  # type: ignore[misc]
        def on_train_batch_gradient_step_end(self, context: Any) -> None:
            ends.append(context.batch_idx)

        def on_train_batch_end(self, context: Any) -> None:
            after.append(flat(context.net))

    trainer = make(sg.ExactTrainer, tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(trainer, sg.SummedLoss(pixel_sum), data, 4, 2, net=net, phase_callbacks=[Watch()])
    reason = {"nan-loss": "non-finite loss", "inf-gradient": "non-finite gradient",
              "no-items": "no items counted in the window"}[poison]  # fmt: skip
    skips = [w for w in caught if w.category is RuntimeWarning and reason in str(w.message)]
    assert len(skips) == 2  # one skip per epoch: the 1st and 2nd warn
    assert (trainer.fb_counters.steps, trainer.fb_counters.skipped_windows) == (2, 2)
    assert ends == [3, 3]  # no step phase for a skipped window
    assert torch.equal(after[4], after[3]) and torch.equal(after[9], after[8])  # untouched
    assert error(net, reference(data, 4, 2, skip=(1, 3))) < 1e-12


@pytest.mark.skipif(REAL, reason="SG enables its GradScaler on CUDA only")
def test_an_inf_gradient_under_a_gradscaler_backs_it_off(sg: Any, tmp_path: Any) -> None:
    data, net, calls = images(8 * PER_MICRO), PixelNet(), []

    def poison(g: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return g * math.inf if len(calls) == 2 else g  # window 0, second micro-batch

    net.head.bias.register_hook(poison)
    trainer = make(sg.ExactTrainer, tmp_path)
    with pytest.warns(RuntimeWarning, match="non-finite gradient.*GradScaler"):
        train(trainer, sg.SummedLoss(pixel_sum), data, 4, 1, net=net, mixed_precision=True)
    assert trainer.scaler.get_scale() == 2.0**16 / 2  # backed off once, no growth since
    assert (trainer.fb_counters.steps, trainer.fb_counters.skipped_windows) == (1, 1)
    assert error(net, reference(data, 4, 1, skip=(0,))) < 1e-12


# -- BatchNorm -----------------------------------------------------------------------------


def test_batchnorm_window_gives_the_full_batch_running_statistics(sg: Any, tmp_path: Any) -> None:
    data = images(4 * PER_MICRO)
    full = PixelNet(batchnorm=True)
    full(torch.stack([d[0] for d in data]))  # one full-batch forward in train mode
    for batchnorm, equal in ((None, False), ("window", True)):
        net = PixelNet(batchnorm=True)
        with pytest.warns(UserWarning, match="BatchNorm") as caught:
            train(make(sg.ExactTrainer, tmp_path, batchnorm=batchnorm),
                  sg.SummedLoss(pixel_sum), data, 4, 1, net=net)  # fmt: skip
        (said,) = [str(w.message) for w in caught if "BatchNorm layer" in str(w.message)]
        assert ("also update once per micro-batch" in said) != equal
        assert int(net.bn.num_batches_tracked) == (1 if equal else 4)
        pairs = [
            (net.bn.running_mean, full.bn.running_mean),
            (net.bn.running_var, full.bn.running_var),
        ]
        assert [torch.allclose(a, b, rtol=1e-12, atol=0) for a, b in pairs] == [equal, equal]


# -- refused -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case, match",
    [
        ("mean loss", "SummedLoss"),
        ("batch_accumulate=0", "positive int"),
        ("batch_accumulate=2.0", "positive int"),
        ("DataParallel", "one process"),
        ("negative count", "finite and >= 0"),
        ("negative count tensor", "negative or not finite"),
        ("loss without count", r"\(loss_sum, count\)"),
    ],
)
def test_misuse_is_refused_before_any_step(sg: Any, tmp_path: Any, case: str, match: str) -> None:
    loss: nn.Module = sg.SummedLoss(pixel_sum)
    net, extra = PixelNet(), dict[str, Any]()
    if case == "mean loss":
        loss = PixelMeanLoss()
    elif case.startswith("batch_accumulate"):
        extra = {"batch_accumulate": 0 if case.endswith("0") else 2.0}
    elif case == "DataParallel":
        net = nn.DataParallel(net)
    elif case == "negative count":
        loss = sg.SummedLoss(lambda out, y: (pixel_sum(out, y)[0], -1))
    elif case == "negative count tensor":
        loss = sg.SummedLoss(lambda out, y: (pixel_sum(out, y)[0], torch.tensor(-1.0)))
    else:
        loss = sg.SummedLoss(lambda out, y: pixel_sum(out, y)[0])
    before = flat(net)
    with pytest.raises(ValueError, match=match):
        train(make(sg.ExactTrainer, tmp_path), loss, images(4 * PER_MICRO), 4, 1, net=net, **extra)
    assert torch.equal(flat(net), before)


def test_other_misuse_is_refused(sg: Any, tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="batchnorm must be None or 'window'"):
        make(sg.ExactTrainer, tmp_path, batchnorm="batch")
    with pytest.raises(ValueError, match="as a dict"):
        make(sg.ExactTrainer, tmp_path).train(PixelNet(), types.MappingProxyType({}))
    # SummedLoss under SG's own Trainer would step on a sum: refused at the first forward.
    net = PixelNet()
    before = flat(net)
    with pytest.raises(RuntimeError, match="ExactTrainer"):
        train(make(sg.Trainer, tmp_path), sg.SummedLoss(pixel_sum), images(8), 4, 1, net=net)
    assert torch.equal(flat(net), before)


# -- what fb.probe says about each route ---------------------------------------------------


def test_the_probe_names_each_route_and_the_fix(sg: Any, tmp_path: Any) -> None:
    """The stock Trainer: wrong, and the fix names this wing; the wing: right, named by its own
    declaration (``fullbatch_route``), not taken for fullbatch.hf.ExactTrainer."""
    data = images(4 * PER_MICRO)
    with fullbatch.probe(objective="token", windows=1) as probe:
        train(make(sg.Trainer, tmp_path), PixelMeanLoss(), data, 4, 1)
    window = probe.report.windows[0]
    assert not probe.report.ok and window.engine == "Super-Gradients"
    assert "fullbatch.super_gradients.ExactTrainer in place of Trainer" in window.diagnosis
    with fullbatch.probe(objective="token", windows=1) as probe:
        train(make(sg.ExactTrainer, tmp_path), sg.SummedLoss(pixel_sum), data, 4, 1)
    assert probe.report.ok, str(probe.report)
    assert probe.report.windows[0].engine == "fullbatch.super_gradients.ExactTrainer"

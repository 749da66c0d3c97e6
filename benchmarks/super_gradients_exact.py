"""Super-Gradients' Trainer, stock vs ``fullbatch.super_gradients``, against a float64 full batch.

Run where Super-Gradients 3.7.1 is installed (not in CI: its requirements do not resolve with
pip; the install is in ``docs/integrations_frameworks.md``), with fullbatch from this checkout:

    PYTHONPATH=src python benchmarks/super_gradients_exact.py

A tiny float64 per-pixel classifier (two convolutions, class-last logits) on 6x6 "images" whose
pixels are ``-100`` (ignored) in different proportions per image, 2 images per micro-batch,
``batch_accumulate=4``, plain SGD. Two scenarios, each with and without ``clip_grad_norm``
(set to half the first window's full-batch gradient norm, so that it clips):

- one window: 4 micro-batches, one epoch: one optimizer step;
- two epochs of 5 micro-batches: the fullbatch route steps on micro-batches 1-4 and 5 of each
  epoch (4 steps); the stock Trainer steps on global micro-batches 4 and 8 (its second window
  runs across the epoch boundary) and never applies the last 2.

The reference is plain PyTorch written here: for each window of the fullbatch route, one
forward and backward of its images as one batch with the pixel-mean loss (``ignore_index``
pixels left out), clipped where asked, one SGD step. Printed: the relative error of each
route's parameter update against the reference's, and what ``fb.probe(objective="token",
windows=<the route's steps>)`` said of the same run (every window checked; the worst one
shown).
"""

from __future__ import annotations

import logging
import math
import tempfile
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import fullbatch as fb

CLASSES, SIDE, PER_MICRO, K, LR = 3, 6, 2, 4, 0.5


class PixelNet(nn.Module):
    """Two convolutions; logits ``[B, H, W, classes]`` (class last, as fb's losses take)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Conv2d(8, CLASSES, 1)
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.conv(x))).movedim(1, -1)


class PixelMeanLoss(nn.Module):
    """A Super-Gradients-style loss: the micro-batch's mean over its counted pixels."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, CLASSES), targets.reshape(-1), ignore_index=-100)


def pixel_sum(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same loss summed, and its pixel count: ``fullbatch.super_gradients.SummedLoss``'s fn."""
    return fb.cross_entropy_sum(logits, targets, ignore_index=-100)


def images(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` (image, targets) pairs; image i has about i/n of its pixels ignored."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        x = torch.randn(3, SIDE, SIDE, generator=g, dtype=torch.float64)
        y = torch.randint(0, CLASSES, (SIDE, SIDE), generator=g)
        ignored = torch.rand(SIDE, SIDE, generator=g) < 0.9 * i / n
        y[ignored] = -100
        y[0, 0] = int(y[0, 0].clamp(min=0))  # at least one counted pixel per image
        out.append((x, y))
    return out


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def reference(data: list[Any], epochs: int, clip: float | None) -> tuple[torch.Tensor, float]:
    """Each window (K micro-batches, or the epoch's rest) as one batch: the update, and the
    first window's gradient norm."""
    net = PixelNet()
    before = flat(net)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    first_norm = math.nan
    per_window = K * PER_MICRO
    for _ in range(epochs):
        for start in range(0, len(data), per_window):
            x = torch.stack([d[0] for d in data[start : start + per_window]])
            y = torch.stack([d[1] for d in data[start : start + per_window]])
            loss = F.cross_entropy(net(x).reshape(-1, CLASSES), y.reshape(-1), ignore_index=-100)
            loss.backward()
            norm = torch.cat([p.grad.reshape(-1) for p in net.parameters()]).norm()
            first_norm = float(norm) if math.isnan(first_norm) else first_norm
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
            opt.step()
            opt.zero_grad()
    return flat(net) - before, first_norm


def train(trainer: Any, loss: nn.Module, data: list[Any], epochs: int, clip: float | None,
          steps: int) -> tuple[torch.Tensor, str, int]:  # fmt: skip
    """One SG training run under the probe: (update, probe columns, micro-batches left in .grad)."""
    net = PixelNet()
    before = flat(net)
    loader = torch.utils.data.DataLoader(
        data,
        batch_size=PER_MICRO,
        collate_fn=lambda b: tuple(torch.stack(t) for t in zip(*b, strict=True)),
    )
    name = type(loss).__name__
    params = {
        "max_epochs": epochs, "lr_mode": None, "initial_lr": LR, "lr_warmup_epochs": 0,
        "warmup_mode": "LinearEpochLRWarmup", "optimizer": "SGD",
        "optimizer_params": {"momentum": 0.0, "weight_decay": 0.0}, "loss": loss,
        "batch_accumulate": K, "clip_grad_norm": clip, "ema": False, "mixed_precision": False,
        "average_best_models": False, "train_metrics_list": [], "valid_metrics_list": [],
        "metric_to_watch": name, "greater_metric_to_watch_is_better": False,
        "save_model": False, "run_validation_freq": 1, "silent_mode": True,
    }  # fmt: skip
    with fb.probe(objective="token", windows=steps) as probe:
        trainer.train(model=net, training_params=params, train_loader=loader, valid_loader=loader)
    left = any(p.grad is not None and bool(p.grad.any()) for p in net.parameters())
    report = probe.report
    worst = max(report.windows, key=lambda w: w.error, default=None)
    if worst is None:
        columns = f"{'right' if report.ok else 'WRONG'} | - | {'; '.join(report.problems)}"
    else:
        patterns = sorted({w.pattern for w in report.windows})
        weights = [x for w in report.windows for x in w.weights if x == x]
        detail = ", ".join(patterns)
        head = worst.diagnosis.split("; ")[0]
        if "not normalized: " in head:  # the constant factor the probe found: x4 (= K), ...
            factor = head.split("not normalized: ")[1].removeprefix("every micro-batch weighted ")
            detail += f", not normalized {factor.split(' (')[0]}"
        if weights and patterns != ["right"]:
            detail += f" (weights {min(weights):.2f}-{max(weights):.2f})"
        verdict = "right" if report.ok else "WRONG"
        checked = f"{len(report.windows)} window{'s' * (len(report.windows) > 1)}"
        columns = f"{verdict} ({checked}) | {worst.error:.1e} | {detail}"
    return flat(net) - before, columns, int(left)


def main() -> None:
    import super_gradients
    from super_gradients.training import Trainer

    from fullbatch.super_gradients import ExactTrainer, SummedLoss

    logging.getLogger("super_gradients").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)  # SG's torch.cuda.amp calls
    print(
        f"Super-Gradients {super_gradients.__version__}, torch {torch.__version__}, float64, "
        f"{PER_MICRO} images of {SIDE}x{SIDE} per micro-batch, batch_accumulate={K}, SGD lr {LR}"
    )
    print("| scenario | route | error vs the full batch | probe | probe error (worst) | probe "
          "pattern |\n|---|---|---|---|---|---|")  # fmt: skip
    scenarios = (("one window", K, 1), ("two epochs, 5 micro-batches each", 5, 2))
    for scenario, n_micro, epochs in scenarios:
        data = images(n_micro * PER_MICRO)
        _, first_norm = reference(data, epochs, None)
        for clip in (None, round(first_norm / 2, 4)):
            ref, _ = reference(data, epochs, clip)
            label = scenario + (f", clip_grad_norm={clip}" if clip else "")
            stock_steps = n_micro * epochs // K
            exact_steps = epochs * math.ceil(n_micro / K)
            with tempfile.TemporaryDirectory() as root:
                routes = [
                    ("stock `Trainer`, pixel-mean loss", Trainer, PixelMeanLoss(), stock_steps),
                    ("`fullbatch.super_gradients.ExactTrainer`, `SummedLoss`", ExactTrainer,
                     SummedLoss(pixel_sum), exact_steps),
                ]  # fmt: skip
                for route, cls, loss, steps in routes:
                    trainer = cls(experiment_name="fullbatch_sg", ckpt_root_dir=root)
                    update, columns, left = train(trainer, loss, data, epochs, clip, steps)
                    error = float((update - ref).norm() / ref.norm())
                    unapplied = n_micro * epochs - steps * K if cls is Trainer else 0
                    note = f" ({unapplied} micro-batches never applied)" if left else ""
                    print(f"| {label} | {route} | {error:.1e}{note} | {columns} |", flush=True)


if __name__ == "__main__":
    main()

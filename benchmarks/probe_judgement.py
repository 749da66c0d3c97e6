"""How precisely ``fb.probe`` measures a window's weights, and where its judge draws the line.

    PYTHONPATH=src python benchmarks/probe_judgement.py            # about 2 minutes, 2 CPU cores
    PYTHONPATH=src python benchmarks/probe_judgement.py --seeds 3  # a quicker look

Right runs (each micro-batch's summed loss divided by the window's item count ``N``) of small
MLP classifiers, over seeds and micro-batch layouts (2 to 8 uneven micro-batches), in four
regimes: bfloat16 autocast with 7 and 256 classes (float32 parameters and gradients), bfloat16
parameters (the loss and ``1 / N`` in bfloat16), float32. For each window: the largest
``|w_k − 1| / σ_k`` over its weights and ``|c − 1| / σ_c`` of its factor, ``σ`` the standard
errors the probe measured on that run (``fullbatch._probe._fit``), and the probe's verdict.
The judge (``fullbatch._probe._judge``) calls a weight off beyond ``Z · σ + u``; a right run
must never reach it. Then the wrong runs the judge exists for, each against a float64 full
batch computed here: a bfloat16 model with a mean of per-micro-batch means, and bfloat16
autocast with every micro-batch weighted 0.993.
"""

from __future__ import annotations

import argparse
import copy
import itertools
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import fullbatch as fb
from fullbatch._probe._judge import Z

LAYOUTS = [(3, 8, 5, 2), (4, 4, 4, 4), (1, 7, 2, 6, 3, 5), (9, 2), (6, 6, 7, 5, 6, 8, 4, 6)]
REGIMES = {  # name: (parameter dtype, autocast, classes, width, rows per layout unit)
    "bf16 autocast, 7 classes": (torch.float32, True, 7, 256, 1),
    "bf16 autocast, 256 classes": (torch.float32, True, 256, 128, 8),
    "bf16 parameters": (torch.bfloat16, False, 7, 64, 1),
    "float32": (torch.float32, False, 7, 64, 1),
}


def mlp(seed: int, dtype: torch.dtype, width: int, classes: int) -> nn.Module:
    torch.manual_seed(seed)
    layers = [nn.Linear(12, width), nn.GELU(), nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, classes)).to(dtype)


def data(sizes: Sequence[int], seed: int, classes: int, dtype: torch.dtype) -> list[dict]:
    g = torch.Generator().manual_seed(seed + 100)
    return [
        {
            "x": torch.randn(n, 12, generator=g).to(dtype),
            "y": torch.randint(classes, (n,), generator=g),
        }
        for n in sizes
    ]


def objective(model: nn.Module, micro: dict) -> Any:
    return fb.cross_entropy_sum(model(micro["x"]), micro["y"])


def window(model: nn.Module, micro_batches: list[dict], loss: Any, autocast: bool) -> Any:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with fb.probe(objective=objective) as probe:
        for micro in micro_batches:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                logits = model(micro["x"])
            loss(logits.float() if autocast else logits, micro).backward()
        applied = [p.grad.detach().clone() for p in model.parameters()]
        opt.step()
    return probe.report.windows[0], applied


def reference_error(model: nn.Module, micro_batches: list[dict], applied: list) -> float:
    ref = copy.deepcopy(model).double()
    x = torch.cat([m["x"] for m in micro_batches]).double()
    F.cross_entropy(ref(x), torch.cat([m["y"] for m in micro_batches])).backward()
    grads = [p.grad for p in ref.parameters()]
    diff = sum(float((a.double() - r).pow(2).sum()) for a, r in zip(applied, grads, strict=True))
    return (diff / sum(float(r.pow(2).sum()) for r in grads)) ** 0.5


def _summed(n: int, factor: float) -> Any:
    """The right loss (summed, over the window's count ``n``), times ``factor``."""
    return lambda logits, m: F.cross_entropy(logits, m["y"], reduction="sum") / n * factor


def _mean_over(k: int) -> Any:
    """Each micro-batch's mean, over ``k``: a mean of per-micro-batch means."""
    return lambda logits, m: F.cross_entropy(logits, m["y"]) / k


def right_runs(seeds: int) -> None:
    print(f"Right runs, {seeds} seeds x {len(LAYOUTS)} layouts each (Z = {Z:g}):\n")
    print(
        "| regime | windows | u | max weight (|w-1| - u)/σ | max factor |c-1|/σ "
        "| max factor (|c-1| - u)/σ | largest |c-1| (its σ) | judged wrong |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, (dtype, autocast, classes, width, scale) in REGIMES.items():
        u = 2.0**-8 if autocast or dtype == torch.bfloat16 else 2.0**-24  # the judge's u
        zw, zc, zu, wrong, worst = [], [], [], 0, (0.0, 0.0)
        for seed, layout in itertools.product(range(seeds), LAYOUTS):
            sizes = [n * scale for n in layout]
            model = mlp(seed, dtype, width, classes)
            batches = data(sizes, seed, classes, dtype)
            n = sum(sizes)
            check, _ = window(model, batches, _summed(n, 1.0), autocast)
            zw.append(
                max(
                    (abs(w - 1) - u) / e
                    for w, e in zip(check.weights, check.precision, strict=True)
                )
            )
            zc.append(abs(check.factor - 1) / check.factor_precision)
            zu.append((abs(check.factor - 1) - u) / check.factor_precision)
            if abs(check.factor - 1) > abs(worst[0]):
                worst = (check.factor - 1, check.factor_precision)
            wrong += not check.ok
        print(
            f"| {name} | {len(zw)} | {u:.1e} | {max(zw):.2f} | {max(zc):.2f} | {max(zu):.2f} "
            f"| {worst[0]:+.1e} ({worst[1]:.0e}) | {wrong} |"
        )


def wrong_runs() -> None:
    print("\nWrong runs, against a float64 full batch:\n")
    print(
        "| run | measured error | probe error | tolerance | ok | pattern | weights (± σ) "
        "| factor (± σ) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    cases = [
        ("bf16 parameters, mean of per-micro-batch means", torch.bfloat16, False, 7, 64,
         (10, 10, 11, 10), 0, None),
        ("bf16 autocast, every micro-batch x0.993", torch.float32, True, 256, 128,
         (32, 32, 32, 32), 0, 0.993),
        ("bf16 autocast, every micro-batch x0.993", torch.float32, True, 256, 128,
         (24, 64, 40, 16), 1, 0.993),
    ]  # fmt: skip
    for name, dtype, autocast, classes, width, sizes, seed, factor in cases:
        model = mlp(seed, dtype, width, classes)
        batches = data(sizes, seed, classes, dtype)
        n = sum(sizes)
        loss = _mean_over(len(sizes)) if factor is None else _summed(n, factor)
        check, applied = window(copy.deepcopy(model), batches, loss, autocast)
        measured = reference_error(model, batches, applied)
        weights = " ".join(f"{w:.3f}" for w in check.weights)
        spread = max(check.precision)
        print(
            f"| {name} {sizes} | {measured:.4f} | {check.error:.4f} | {check.tolerance:.4f} | "
            f"{check.ok} | {check.pattern} | {weights} (± {spread:.0e}) | "
            f"{check.factor:.4f} (± {check.factor_precision:.0e}) |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    right_runs(args.seeds)
    wrong_runs()


if __name__ == "__main__":
    main()

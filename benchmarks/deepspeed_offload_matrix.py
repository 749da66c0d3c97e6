"""Which ZeRO ``offload_optimizer`` configurations the installed deepspeed accumulates exactly.

Why ``fullbatch.deepspeed`` refuses what it refuses (``fullbatch._wings._deepspeed.refusal``): for
ZeRO stages 1 and 2 with ``offload_optimizer: cpu``, 1 and 2 ranks, the engine's
``gradient_accumulation_steps`` 4 (four micro-batches) or 1 (four ``engine.backward`` calls with
the boundary set by hand: DeepSpeed #7981's case), it runs one window of
``fullbatch.deepspeed.ExactEngine`` **with its refusal bypassed** and prints the relative error of
the applied update against a float64 full batch over every rank's rows (uneven micro-batches,
``-100`` labels; tests/_ds_cases.py's data and model, SGD). ``ok`` below 1e-4 (float32: ~3e-7).

Installs nothing; CPU, gloo (tests/_dist_ds.py's harness)::

    python benchmarks/deepspeed_offload_matrix.py
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import _ds_cases as cases
from _dist_ds import config, run_ds, values

BAND = 1e-4


def rank_fn(rank: int, world: int) -> dict[tuple[int, int], tuple[Any, Any]]:
    import deepspeed

    import fullbatch as fb
    import fullbatch.deepspeed as fds

    fds.check_engine = lambda *a, **k: None  # type: ignore[assignment]  # measured, not refused
    out = {}
    for stage in (1, 2):
        for ga in (4, 1):
            model = cases.make_model(torch.float32)
            opt = torch.optim.SGD(model.parameters(), lr=cases.LR)
            cfg = config(stage, offload=True, micro_batches=ga, world=world, clip=0.0)
            engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
            exact = fds.ExactEngine(engine, count=lambda m: (m["y"] != -100).sum(), micro_batches=4)
            start = cases.full_params(engine)
            loader = [
                {k: v.float() if v.is_floating_point() else v for k, v in m.items()}
                for m in cases.micro_batches(rank)[:4]
            ]
            for window in exact.windows(loader):
                for micro in window:
                    window.backward(*fb.cross_entropy_sum(engine(micro["x"]), micro["y"]))
                window.step()
            out[(stage, ga)] = (start, cases.full_params(engine))
    return out


def full_batch_update(world: int) -> list[torch.Tensor]:
    model = cases.make_model(torch.float64)
    micros = [m for r in range(world) for m in cases.micro_batches(r)[:4]]
    x = torch.cat([m["x"] for m in micros])
    y = torch.cat([m["y"] for m in micros])
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return [-cases.LR * p.grad for p in model.parameters()]


def main() -> None:
    import deepspeed

    print(f"deepspeed {deepspeed.__version__}, offload_optimizer: cpu, ExactEngine's refusal off")
    print("| ranks | ZeRO stage | engine gradient_accumulation_steps | update error |")
    print("|---|---|---|---|")
    for world in (1, 2):
        want = full_batch_update(world)
        for (stage, ga), (start, end) in values(run_ds(rank_fn, world, deadline=600))[0].items():
            got = [a - b for a, b in zip(end, start, strict=True)]
            num = sum(float((g - w).pow(2).sum()) for g, w in zip(got, want, strict=True))
            err = (num / sum(float(w.pow(2).sum()) for w in want)) ** 0.5
            calls = "4 (4 micro-batches)" if ga == 4 else "1 (4 backward calls)"
            print(f"| {world} | {stage} | {calls} | {err:.1e} {'ok' if err < BAND else 'WRONG'} |")


if __name__ == "__main__":
    main()

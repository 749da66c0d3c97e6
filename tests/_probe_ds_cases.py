"""Rank functions for the probe on DeepSpeed (tests/probe/test_probe_deepspeed.py).

:func:`raw` runs every case of its list on one engine each, in one process group: a raw
``deepspeed.initialize`` script (``engine(x)``, ``engine.backward``, ``engine.step`` after each
micro-batch), ``WINDOWS`` windows of ``K`` micro-batches of uneven rows (about 30% of the
labels ignored), trained twice from the same start: plain, and under ``fb.probe(windows=2)``
(the run goes on after the probed windows). It returns both runs' full parameters after every
step (``safe_get_full_fp32_param``), the probed run's report and what DeepSpeed measured.

A case is ``(stage, offload, how, clip, groups)``; ``how``: ``"right"`` (each micro-batch's
loss sum times ``world / N``, ``N`` the window's items over every micro-batch and rank, with
``scale_wrt_gas=False``: DeepSpeed averages over the ranks), ``"mean/K"`` (the stock
per-micro-batch mean through ``engine.backward``, which divides by ``K``: the mean of
per-micro-batch means), ``"exact"`` (``fullbatch.deepspeed.ExactEngine``); ``clip``:
DeepSpeed's ``gradient_clipping``; ``groups``: the optimizer's parameter groups (2: DeepSpeed
steps the torch optimizer twice per step). ZeRO-3 partitions every parameter
(``stage3_param_persistence_threshold`` 0) unless the case's stage is ``"3p"`` (DeepSpeed's
default: these small parameters stay whole).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

IN, HIDDEN, OUT = 6, 8, 5
K, WINDOWS = 4, 3


def make_model() -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT)
        )


def micro_batches(rank: int) -> list[dict[str, torch.Tensor]]:
    """Rank ``rank``'s ``K`` micro-batches of 1-4 rows (each window trains on the same ones)."""
    out = []
    for k in range(K):
        g = torch.Generator().manual_seed(100 * rank + k)
        rows = 1 + (k + 2 * rank) % 4
        y = torch.randint(0, OUT, (rows,), generator=g)
        y[torch.rand(rows, generator=g) < 0.3] = -100
        y[0] = 1  # at least one counted item per micro-batch
        out.append({"x": torch.randn(rows, IN, generator=g), "y": y})
    return out


def counted(micro: dict[str, torch.Tensor]) -> int:
    return int((micro["y"] != -100).sum())


def objective(model: torch.nn.Module, micro: dict[str, torch.Tensor]) -> tuple[Any, Any]:
    import fullbatch as fb

    return fb.cross_entropy_sum(model(micro["x"]), micro["y"])


def _engine(world: int, case: tuple[Any, ...]) -> Any:
    import deepspeed

    from _dist_ds import config

    stage, offload, _how, clip, groups = case
    model = make_model()
    params: Any = model.parameters()
    if groups == 2:  # weights and biases apart (as the Hugging Face Trainer's decay groups)
        params = [
            {"params": [model[0].weight, model[2].weight]},
            {"params": [model[0].bias, model[2].bias], "weight_decay": 0.0},
        ]
    opt = torch.optim.SGD(params, lr=0.5, momentum=0.9)
    zero = 3 if stage == "3p" else stage
    cfg = config(zero, offload=offload, micro_batches=K, world=world, clip=clip)
    if stage == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return engine


def full_params(engine: Any) -> list[torch.Tensor]:
    from deepspeed.utils import safe_get_full_fp32_param

    out = []
    for p in engine.module.parameters():
        full = safe_get_full_fp32_param(p)
        out.append((p if full is None else full).detach().clone())
    return out


def _train(engine: Any, rank: int, world: int, how: str) -> list[list[torch.Tensor]]:
    import torch.distributed as dist

    import fullbatch as fb
    from fullbatch.deepspeed import ExactEngine

    micros = micro_batches(rank)
    out = []
    if how == "exact":
        exact = ExactEngine(engine, count=lambda m: (m["y"] != -100).sum())
        for window in exact.windows(micros * WINDOWS):
            for micro in window:
                window.backward(*objective(engine, micro))
            window.step()
            out.append(full_params(engine))
        return out
    n = torch.tensor(float(sum(counted(m) for m in micros)))
    dist.all_reduce(n)
    for _ in range(WINDOWS):
        for micro in micros:
            logits = engine(micro["x"])
            if how == "right":
                loss_sum, _ = fb.cross_entropy_sum(logits, micro["y"])
                engine.backward(loss_sum * world / n, scale_wrt_gas=False)
            else:  # "mean/K": DeepSpeed's own 1/K on a per-micro-batch mean
                engine.backward(torch.nn.functional.cross_entropy(logits, micro["y"]))
            engine.step()
        out.append(full_params(engine))
    return out


def _case(rank: int, world: int, case: tuple[Any, ...]) -> dict[str, Any]:
    import fullbatch as fb

    out: dict[str, Any] = {}
    for probed in (False, True):
        engine = _engine(world, case)
        probe = fb.probe(objective=objective, windows=2) if probed else contextlib.nullcontext()
        try:
            with probe:
                params = _train(engine, rank, world, case[2])
        except ValueError as refused:  # ExactEngine on a DeepSpeed it cannot make exact
            return {"refused": str(refused)}
        out["probed" if probed else "plain"] = params
        if probed:
            out["report"] = probe.report  # type: ignore[union-attr]
    return out


def raw(rank: int, world: int, cases: list[tuple[Any, ...]]) -> dict[Any, Any]:
    """Every case of ``cases`` (see the module docstring), and the deepspeed version."""
    import deepspeed

    out: dict[Any, Any] = {case: _case(rank, world, case) for case in cases}
    out["version"] = deepspeed.__version__
    return out


def reference(world: int) -> list[torch.Tensor]:
    """The first window's full gradient in float64: every rank's micro-batches as one batch,
    the mean cross-entropy over the counted rows, from the initial parameters."""
    model = make_model().double()
    micros = [m for r in range(world) for m in micro_batches(r)]
    x = torch.cat([m["x"] for m in micros]).double()
    y = torch.cat([m["y"] for m in micros])
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return [p.grad.detach().clone() for p in model.parameters()]

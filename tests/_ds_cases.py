"""Rank functions for the raw DeepSpeed tests (tests/integrations/test_deepspeed_engine.py).

Rank ``r`` reads ``6 - r`` micro-batches (rows 1-4, ~30% ``-100`` labels) with
``gradient_accumulation_steps=4``: window 0 holds 4 micro-batches on every rank, window 1 (the
partial last one) 2 on rank 0 and 1 on rank 1, which runs a padding micro-batch. Every rank
returns its full parameters after every step (``safe_get_full_fp32_param``), the stats, and
what it warned.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

IN, HIDDEN, OUT, K = 6, 8, 5, 4
LR, MOMENTUM, DECAY = 0.5, 0.9, 0.01


def make_model(dtype: torch.dtype) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT)
        )
    return model.to(dtype)


def micro_batches(rank: int, dtype: torch.dtype = torch.float64) -> list[dict[str, Any]]:
    """Rank ``rank``'s loader: ``6 - rank`` micro-batches of 1-4 rows."""
    out = []
    for k in range(6 - rank):
        g = torch.Generator().manual_seed(100 * rank + k)
        rows = 1 + (k + 2 * rank) % 4
        y = torch.randint(0, OUT, (rows,), generator=g)
        y[torch.rand(rows, generator=g) < 0.3] = -100
        out.append({"x": torch.randn(rows, IN, generator=g, dtype=dtype), "y": y})
    return out


def windows_of(world: int) -> list[list[dict[str, Any]]]:
    """Every rank's micro-batches of each window, as the reference takes them."""
    loaders = [micro_batches(r) for r in range(world)]
    return [[m for ms in loaders for m in ms[w * K : (w + 1) * K]] for w in range(2)]


def reference(world: int, clip: float) -> list[list[torch.Tensor]]:
    """Plain PyTorch, float64: each window's rows as one batch, mean cross-entropy over the
    labelled rows, optional clipping, SGD with momentum and weight decay. Params per step."""
    model = make_model(torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=DECAY)
    out = []
    for micros in windows_of(world):
        x = torch.cat([m["x"] for m in micros])
        y = torch.cat([m["y"] for m in micros])
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append([p.detach().clone() for p in model.parameters()])
    return out


def _engine(world: int, stage: int, offload: bool, clip: float, dtype: torch.dtype) -> Any:
    import deepspeed

    from _dist_ds import config

    model = make_model(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=DECAY)
    cfg = config(stage, offload=offload, micro_batches=K, world=world, clip=clip)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return engine


def _accelerated(world: int, stage: int, offload: bool, clip: float, dtype: torch.dtype) -> Any:
    """The engine (and optimizer) Accelerate's DeepSpeed plugin prepares from the same config."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin

    from _dist_ds import config

    AcceleratorState._reset_state(True)  # one Accelerator per engine in this process
    model = make_model(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=DECAY)
    cfg = config(stage, offload=offload, micro_batches=K, world=world, clip=clip)
    plugin = DeepSpeedPlugin(hf_ds_config=cfg)
    accelerator = Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=K)
    return accelerator.prepare(model, opt)


def accumulator_refuses(rank: int, world: int) -> str:
    """fb.Accumulator on what Accelerate's DeepSpeed plugin prepared: refused, nothing moved."""
    import fullbatch as fb

    engine, optimizer = _accelerated(world, 2, False, 0.0, torch.float32)
    before = full_params(engine)
    try:
        fb.Accumulator(engine, optimizer, micro_batches=K)
    except ValueError as exc:
        same = all(torch.equal(a, b) for a, b in zip(before, full_params(engine), strict=True))
        return f"{exc} | unchanged={same}"
    return "accepted"


def full_params(engine: Any) -> list[torch.Tensor]:
    from deepspeed.utils import safe_get_full_fp32_param

    out = []
    for p in engine.module.parameters():
        full = safe_get_full_fp32_param(p)
        out.append((p if full is None else full).detach().double().clone())
    return out


def _labels(micro: dict[str, Any]) -> torch.Tensor:
    return (micro["y"] != -100).sum()


def train(
    rank: int, world: int, stage: int, offload: bool, clip: float, dtype: torch.dtype, route: str
) -> dict[str, Any]:
    """Two windows with fullbatch's route (``"exact"``; ``"accelerate"``: the same on the
    engine Accelerate's DeepSpeed plugin prepared) or a stock per-micro-batch mean loss through
    ``engine.backward`` (``"stock"``)."""
    import fullbatch as fb
    from fullbatch.deepspeed import ExactEngine

    if route == "accelerate":
        engine, _ = _accelerated(world, stage, offload, clip, dtype)
    else:
        engine = _engine(world, stage, offload, clip, dtype)
    out: dict[str, Any] = {"params": [], "stats": []}
    loader = [
        {k: v.to(dtype) if v.is_floating_point() else v for k, v in m.items()}
        for m in micro_batches(rank)
    ]
    if route == "stock":  # window 0 only: ranks hold 2 and 1 micro-batches in window 1
        for w in range(1):
            micros = loader[w * K : (w + 1) * K]
            for i, m in enumerate(micros):
                engine.set_gradient_accumulation_boundary(i == len(micros) - 1)
                engine.backward(torch.nn.functional.cross_entropy(engine(m["x"]), m["y"]))
            engine.step()
            out["params"].append(full_params(engine))
        return out
    exact = ExactEngine(engine, count=_labels)
    for window in exact.windows(loader):
        padding = []
        for micro in window:
            padding.append(window.is_padding)
            loss_sum, n = fb.cross_entropy_sum(engine(micro["x"]), micro["y"])
            window.backward(loss_sum, n)
        out["stats"].append(window.step())
        out["params"].append(full_params(engine))
        out.setdefault("padding", []).append(padding)
    return out


def train_all(rank: int, world: int, runs: list[tuple[Any, ...]]) -> dict[Any, Any]:
    """Every ``(stage, offload, clip, dtype, route)`` of ``runs``, one engine each."""
    return {run: train(rank, world, *run) for run in runs}


def skips(rank: int, world: int, stage: int, offload: bool) -> dict[str, Any]:
    """Three windows; window 1 poisoned (a NaN input on the last rank's 2nd micro-batch) or
    all-ignored (every label -100 on every rank). Snapshots after each window."""
    import fullbatch as fb
    from fullbatch.deepspeed import ExactEngine

    out: dict[str, Any] = {}
    for mode in ("nan", "no_items"):
        engine = _engine(world, stage, offload, 0.0, torch.float32)
        exact = ExactEngine(engine, count=_labels)
        loader = [
            {"x": m["x"].float(), "y": m["y"]} for m in micro_batches(0)[:4] * 3
        ]  # 3 full windows, the same on every rank
        for k in range(4, 8):
            loader[k] = dict(loader[k])
            if mode == "nan" and k == 5 and rank == world - 1:
                loader[k]["x"] = loader[k]["x"].clone()
                loader[k]["x"][0, 0] = float("nan")
            if mode == "no_items":
                loader[k]["y"] = torch.full_like(loader[k]["y"], -100)
        res: dict[str, Any] = {"params": [], "stats": [], "state": [], "ran": []}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for window in exact.windows(loader):
                ran = 0
                for micro in window:
                    ran += 1
                    loss_sum, n = fb.cross_entropy_sum(engine(micro["x"]), micro["y"])
                    window.backward(loss_sum, n)
                res["ran"].append(ran)
                res["stats"].append(window.step())
                res["params"].append(full_params(engine))
                res["state"].append(_momentum(engine))
        res["warnings"] = [str(w.message) for w in caught if "was skipped" in str(w.message)]
        res["steps"] = (exact.steps, exact.skipped_windows)
        out[mode] = res
    return out


def _momentum(engine: Any) -> list[torch.Tensor]:
    """The optimizer's momentum buffers on this rank (partitioned at ZeRO 1-3)."""
    state = engine.optimizer.state if hasattr(engine.optimizer, "state") else {}
    return [
        v["momentum_buffer"].detach().double().clone()
        for v in state.values()
        if isinstance(v, dict) and v.get("momentum_buffer") is not None
    ]


def mismatch(rank: int, world: int) -> str:
    """A count function that forgets the ignored labels: refused before DeepSpeed steps."""
    import fullbatch as fb
    from fullbatch.deepspeed import ExactEngine

    engine = _engine(world, 2, False, 0.0, torch.float32)
    exact = ExactEngine(engine, count=lambda m: len(m["y"]))
    before = full_params(engine)
    loader = [{"x": m["x"].float(), "y": m["y"]} for m in micro_batches(0)[:4]]
    try:
        for window in exact.windows(loader):
            for micro in window:
                window.backward(*fb.cross_entropy_sum(engine(micro["x"]), micro["y"]))
    except ValueError as exc:
        unchanged = all(
            torch.equal(a, b) for a, b in zip(before, full_params(engine), strict=False)
        )
        return f"{exc} | unchanged={unchanged}"
    return "no error"

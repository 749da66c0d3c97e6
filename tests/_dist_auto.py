"""Rank functions for ``micro_batch_size="auto"`` under DDP and FSDP2 (see test_distributed_auto).

Each rank's model has a threshold layer after its first Linear that raises
``torch.OutOfMemoryError`` when a forward sees more rows than that rank "fits": under FSDP2
the first Linear has all-gathered by then, so the other ranks go on to the next all-gather.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import fullbatch as fb
from _dist_cases import HIDDEN, IN, OUT, _full_params, make_optimizer, micro_batch, wrap


class Fits(nn.Module):
    def __init__(self, rows: int, fail_calls: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.rows = rows
        self.fail_calls = fail_calls  # forwards that fail whatever their size (fragmentation)
        self.calls: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(x.shape[0])
        if x.shape[0] > self.rows or len(self.calls) - 1 in self.fail_calls:
            raise torch.OutOfMemoryError(f"{x.shape[0]} rows do not fit (threshold {self.rows})")
        return x


def make_model(rows: int, fail_calls: tuple[int, ...] = ()) -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Linear(IN, HIDDEN), nn.Tanh(), Fits(rows, fail_calls), nn.Linear(HIDDEN, OUT)]
    return nn.Sequential(*layers).double()


def items(rank: int, rows: list[list[int]]) -> list[dict[str, torch.Tensor]]:
    """Rank ``rank``'s loader items: each one a whole window."""
    return [micro_batch(rank, i, n) for i, n in enumerate(rows[rank])]


def reference_windows(rows: list[list[int]]) -> list[list[dict[str, torch.Tensor]]]:
    n = max(len(r) for r in rows)
    return [[items(r, rows)[w] for r in range(len(rows)) if w < len(rows[r])] for w in range(n)]


def auto_train(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    fits = spec["fits"][rank]
    fail_calls = tuple(spec.get("fail_calls", [(), ()])[rank])
    model = wrap(make_model(fits, fail_calls), spec["wrapper"])
    threshold = next(m for m in model.modules() if isinstance(m, Fits))
    opt = make_optimizer(model.parameters())
    out: dict[str, Any] = {"params": [], "retries": [], "sizes": [], "micro": []}
    with fb.Accumulator(model, opt, micro_batch_size="auto", **spec.get("options", {})) as acc:
        for window in acc.windows(items(rank, spec["rows"])):
            stats = window.run(lambda m: fb.cross_entropy_sum(model(m["x"]), m["y"]))
            assert all(p.grad is None for p in model.parameters())
            assert getattr(model, "require_backward_grad_sync", True) is True
            out["params"].append(_full_params(model))
            out["retries"].append(stats.retries)
            out["sizes"].append(acc.micro_batch_size)
            out["micro"].append(stats.micro_batches)
    out["calls"] = threshold.calls
    return out


def _bn_run(rank: int, size: int | str, fits: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    layers = [nn.Linear(IN, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.Tanh(), Fits(fits)]
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(*layers, nn.Linear(HIDDEN, OUT)).double()
    )
    opt = make_optimizer(model.parameters())
    snaps = []
    options = {"batchnorm": "window", "ddp_sync": "step"}  # "auto" reduces at step() too
    with fb.Accumulator(model, opt, micro_batch_size=size, **options) as acc:
        for window in acc.windows(items(rank, [[8, 8, 6], [8, 6, 8]])):
            window.run(lambda m: fb.cross_entropy_sum(model(m["x"]), m["y"]))
            buffers = torch.cat([b.reshape(-1).double() for b in model.buffers()])
            snaps.append((_full_params(model), buffers))
    return snaps


def auto_ddp_batchnorm(rank: int, world: int) -> dict[str, Any]:
    """DDP broadcasts BatchNorm buffers in every forward: a collective "auto" must agree on."""
    return {"auto": _bn_run(rank, "auto", [10**9, 3][rank]), "fixed": _bn_run(rank, 2, 10**9)}


def ddp_sync_with_auto(rank: int, world: int) -> dict[str, Any]:
    """DDP's sync flag on each micro-batch: "auto" with ``ddp_sync`` left out, with "step",
    and a fixed size; then ``ddp_sync="last"`` with "auto", which is refused."""
    model = wrap(make_model(10**9), "ddp")
    opt = make_optimizer(model.parameters())
    item = [micro_batch(rank, 0, 8)]
    out: dict[str, Any] = {}
    for name, options in [
        ("default", {"micro_batch_size": "auto"}),
        ("step", {"micro_batch_size": "auto", "ddp_sync": "step"}),
        ("fixed", {"micro_batch_size": 4}),
    ]:
        flags: list[bool] = []

        def fn(m: dict[str, torch.Tensor], flags: list[bool] = flags) -> Any:
            flags.append(bool(model.require_backward_grad_sync))
            return fb.cross_entropy_sum(model(m["x"]), m["y"])

        with fb.Accumulator(model, opt, **options) as acc:
            for window in acc.windows(item):
                window.run(fn)
        out[name] = flags
    before = _full_params(model)
    state = [t.clone() for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    out["refused"] = []
    for size in ("micro_batch_size", "micro_batch_tokens"):
        try:
            fb.Accumulator(model, opt, ddp_sync="last", **{size: "auto"})
        except ValueError as error:
            out["refused"].append(str(error))
    after = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    out["unchanged"] = (
        torch.equal(before, _full_params(model))
        and len(state) == len(after) > 0
        and all(torch.equal(a, b) for a, b in zip(state, after, strict=True))
    )
    out["flag"] = bool(model.require_backward_grad_sync)
    return out

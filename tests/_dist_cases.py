"""Rank functions for the multi-process tests, and the single-process references they meet.

Each rank function runs in a child process (see ``_dist.run_ranks``) and returns plain data:
the full parameters after every step, and the StepStats. The parent computes the float64
full-batch reference on the union of every rank's data and compares.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import fullbatch as fb

IN, HIDDEN, OUT = 6, 16, 4


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT)).double()


def micro_batch(rank: int, index: int, rows: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic micro-batch ``index`` of ``rank``; about a quarter of labels ignored."""
    g = torch.Generator().manual_seed(seed * 100_003 + rank * 1009 + index)
    x = torch.randn(rows, IN, generator=g, dtype=torch.float64)
    y = torch.randint(0, OUT, (rows,), generator=g)
    y[torch.rand(rows, generator=g) < 0.25] = -100
    return {"x": x, "y": y}


def rank_data(rank: int, layout: list[list[int]], seed: int = 0) -> list[dict[str, torch.Tensor]]:
    return [micro_batch(rank, i, rows, seed) for i, rows in enumerate(layout[rank])]


def reference_windows(
    layout: list[list[int]], k: int, drop: bool = False, seed: int = 0
) -> list[list[dict[str, torch.Tensor]]]:
    """The union of every rank's micro-batches, window by window (micro_batches=k per rank)."""
    data = [rank_data(r, layout, seed) for r in range(len(layout))]
    n_windows = max((len(d) + k - 1) // k for d in data)
    windows = []
    for w in range(n_windows):
        parts = [d[w * k : (w + 1) * k] for d in data]
        if drop and any(len(p) < k for p in parts):
            continue
        windows.append([m for p in parts for m in p])
    return windows


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def reference_run(
    windows: list[list[dict[str, torch.Tensor]]], max_grad_norm: float | None = None
) -> list[torch.Tensor]:
    """Plain PyTorch, float64, full batch: flat parameters after every non-skipped step."""
    model = make_model()
    opt = make_optimizer(model.parameters())
    out = []
    for window in windows:
        x = torch.cat([m["x"] for m in window])
        y = torch.cat([m["y"] for m in window])
        n = int((y != -100).sum())
        if n == 0:
            continue
        loss = nn.functional.cross_entropy(model(x), y, ignore_index=-100, reduction="sum") / n
        opt.zero_grad()
        loss.backward()
        if max_grad_norm is not None:
            nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        out.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return out


def _full_params(model: nn.Module) -> torch.Tensor:
    parts = []
    for p in model.parameters():
        t = p.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        parts.append(t.reshape(-1))
    return torch.cat(parts)


def wrap(model: nn.Module, wrapper: str, group: Any = None) -> nn.Module:
    if wrapper == "ddp":
        return nn.parallel.DistributedDataParallel(model, process_group=group)
    if wrapper == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        return fully_shard(model)
    raise ValueError(wrapper)


def fit(
    model: nn.Module, loader: Any, k: int = 2, **options: Any
) -> list[tuple[Any, torch.Tensor]]:
    """The standard fullbatch loop; ``(StepStats, full parameters)`` after every window."""
    opt = make_optimizer(model.parameters())
    out = []
    with fb.Accumulator(model, opt, micro_batches=k, **options) as acc:
        for window in acc.windows(loader):
            for micro in window:
                loss_sum, n = fb.cross_entropy_sum(model(micro["x"]), micro["y"])
                window.backward(loss_sum, n)
            out.append((window.step(), _full_params(model)))
            # The model's own sync flag is back after every window (DDP's default: True).
            assert getattr(model, "require_backward_grad_sync", True) is True
    return out


def train(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Train on this rank's micro-batches with fullbatch; return params after every step."""
    layout = spec["layout"]
    model = wrap(make_model(), spec["wrapper"])
    opt = make_optimizer(model.parameters())
    options = dict(spec.get("options", {}))
    if spec.get("padding"):
        options["padding_micro_batch"] = lambda: micro_batch(rank, 999, 2)
    data = rank_data(rank, layout, spec.get("seed", 0))
    loader = iter(data) if spec.get("unsized") else data
    snapshots, stats, paddings = [], [], []
    with fb.Accumulator(model, opt, micro_batches=spec["k"], **options) as acc:
        for window in acc.windows(loader):
            pads = 0
            for micro in window:
                pads += window.is_padding
                loss_sum, n = fb.cross_entropy_sum(model(micro["x"]), micro["y"])
                window.backward(loss_sum, n)
            s = window.step()
            stats.append(s)
            paddings.append(pads)
            if not s.skipped:
                snapshots.append(_full_params(model))
    return {"params": snapshots, "stats": stats, "paddings": paddings}


def reference_for(spec: dict[str, Any]) -> list[torch.Tensor]:
    drop = spec.get("options", {}).get("partial_window") == "drop"
    windows = reference_windows(spec["layout"], spec["k"], drop=drop, seed=spec.get("seed", 0))
    return reference_run(windows, spec.get("options", {}).get("max_grad_norm"))


def world_size() -> int:
    return dist.get_world_size()


# -- scenarios beyond plain training ------------------------------------------------------------


def two_backwards(rank: int, world: int, ddp_sync: str) -> list[torch.Tensor]:
    """Two loss terms with different denominators, one backward each, per micro-batch."""
    layout = [[3, 2, 4], [1, 5]]
    model = wrap(make_model(), "ddp")
    opt = make_optimizer(model.parameters())

    def n_rows(m: dict[str, torch.Tensor]) -> int:
        return m["x"].shape[0]

    counts = {"tokens": lambda m: int((m["y"] != -100).sum()), "rows": n_rows}
    snaps = []
    with fb.Accumulator(model, opt, micro_batches=2, counts=counts, ddp_sync=ddp_sync) as acc:
        for window in acc.windows(rank_data(rank, layout)):
            totals = window.totals
            for micro in window:
                out = model(micro["x"])
                ce, _ = fb.cross_entropy_sum(out, micro["y"])
                window.backward(ce / totals["tokens"], retain_graph=True)
                window.backward(out.square().sum() / totals["rows"])
            window.step()
            snaps.append(_full_params(model))
    return snaps


def two_backwards_reference() -> list[torch.Tensor]:
    layout = [[3, 2, 4], [1, 5]]
    windows = reference_windows(layout, 2)
    model = make_model()
    opt = make_optimizer(model.parameters())
    snaps = []
    for window in windows:
        x = torch.cat([m["x"] for m in window])
        y = torch.cat([m["y"] for m in window])
        out = model(x)
        ce = nn.functional.cross_entropy(out, y, reduction="sum") / (y != -100).sum()
        loss = ce + out.square().sum() / x.shape[0]
        opt.zero_grad()
        loss.backward()
        opt.step()
        snaps.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return snaps


class Gated(nn.Module):
    """Conditional compute: the second head runs only for micro-batches whose first x > 0."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(IN, HIDDEN).double()
        self.head = nn.Linear(HIDDEN, OUT).double()
        self.extra = nn.Linear(HIDDEN, OUT).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        out = self.head(h)
        if float(x[0, 0]) > 0:
            out = out + self.extra(h)
        return out


def conditional(rank: int, world: int, find_unused: bool) -> list[torch.Tensor]:
    layout = [[2, 3, 2, 1], [3, 1, 2, 2]]
    model = nn.parallel.DistributedDataParallel(Gated(), find_unused_parameters=find_unused)
    return [params for _, params in fit(model, rank_data(rank, layout, seed=3))]


def conditional_reference() -> list[torch.Tensor]:
    layout = [[2, 3, 2, 1], [3, 1, 2, 2]]
    model = Gated()
    opt = make_optimizer(model.parameters())
    snaps = []
    for window in reference_windows(layout, 2, seed=3):
        opt.zero_grad()
        total = sum(int((m["y"] != -100).sum()) for m in window)
        for m in window:  # per micro-batch forward: the gate depends on the micro-batch
            out = model(m["x"])
            loss = nn.functional.cross_entropy(out, m["y"], reduction="sum") / total
            loss.backward()
        opt.step()
        snaps.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return snaps


def static_graph(rank: int, world: int) -> list[torch.Tensor]:
    layout = [[3, 1, 4, 2, 5], [2, 6, 1]]
    model = nn.parallel.DistributedDataParallel(make_model(), static_graph=True)
    return [params for _, params in fit(model, rank_data(rank, layout))]


def subgroups(rank: int, world: int, mode: str) -> list[torch.Tensor]:
    """4 ranks, data-parallel groups {0, 1} and {2, 3}; each group trains on its own data."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[rank // 2]
    member = rank % 2
    layout = [[3, 1, 4, 2], [2, 5, 1]]
    model = nn.parallel.DistributedDataParallel(make_model(), process_group=group)
    options: dict[str, Any] = {}
    if mode == "conflict":
        options["process_group"] = dist.group.WORLD
    if mode == "sum-hook":

        def summing(state, bucket):  # type: ignore[no-untyped-def]  (DDP checks annotations)
            fut = dist.all_reduce(bucket.buffer(), group=state, async_op=True).get_future()
            return fut.then(lambda f: f.value()[0])

        model.register_comm_hook(group, summing)
        options["grad_divisor"] = 1
    seed = 10 + rank // 2  # each group has its own data
    return [params for _, params in fit(model, rank_data(member, layout, seed=seed), **options)]


def subgroup_reference(group_index: int) -> list[torch.Tensor]:
    layout = [[3, 1, 4, 2], [2, 5, 1]]
    return reference_run(reference_windows(layout, 2, seed=10 + group_index))


def nonfinite(rank: int, world: int) -> list[Any]:
    """Rank 1's second micro-batch of window 0 has an inf input: window 0 skips everywhere."""
    layout = [[2, 3, 2, 2], [3, 2, 1, 2]]
    data = rank_data(rank, layout)
    if rank == 1:
        data[1]["x"][0, 0] = float("inf")
    return [(s.skipped, s.reason, s.steps, p) for s, p in fit(wrap(make_model(), "ddp"), data)]


def skip_final_backward(rank: int, world: int) -> None:
    """The user's loop skips backward on a micro-batch with no items: rank 1's final one."""
    layout = [[2, 3], [2, 2]]
    model = wrap(make_model(), "ddp")
    opt = make_optimizer(model.parameters())
    data = rank_data(rank, layout)
    if rank == 1:
        data[1]["y"][:] = -100
    with fb.Accumulator(model, opt, micro_batches=2) as acc:
        for window in acc.windows(data):
            for micro in window:
                loss_sum, n = fb.cross_entropy_sum(model(micro["x"]), micro["y"])
                if n == 0:
                    continue
                window.backward(loss_sum, n)
            window.step()


class UserError(Exception):
    pass


def raise_in_micro_batch(rank: int, world: int) -> None:
    layout = [[2, 3, 2, 2], [3, 2, 1, 2]]
    model = wrap(make_model(), "ddp")
    opt = make_optimizer(model.parameters())
    with fb.Accumulator(model, opt, micro_batches=4) as acc:
        for window in acc.windows(rank_data(rank, layout)):
            for i, micro in enumerate(window):
                if rank == 1 and i == 2:
                    raise UserError("boom in micro-batch 2")
                loss_sum, n = fb.cross_entropy_sum(model(micro["x"]), micro["y"])
                window.backward(loss_sum, n)
            window.step()


def count_collectives(rank: int, world: int, wrapper: str, loop: str) -> dict[str, int]:
    """Count gradient reductions and tiny collectives over 3 windows of K=3 micro-batches.

    DDP's gradient all-reduces are counted by a comm hook (one call per bucket); FSDP2's
    reduce-scatters and the tiny collectives by wrapping the torch.distributed functions.
    """
    layout = [[2, 3, 1, 2, 2, 3, 1, 1, 2], [3, 1, 2, 2, 1, 2, 3, 2, 1]]
    k = 3
    model = make_model()
    calls = {"grad": 0, "tiny": 0}

    def counted(real: Any, key: str, ours_only: bool) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            # "tiny" counts only what fullbatch itself issues (FSDP2 all-gathers too).
            caller = sys._getframe(1).f_globals["__name__"]
            if not ours_only or caller.startswith("fullbatch._base._sync"):  # the _sync package
                calls[key] += 1
            return real(*args, **kwargs)

        return call

    if wrapper == "ddp":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0005)

        def counting(state, bucket):  # type: ignore[no-untyped-def]  (DDP checks annotations)
            calls["grad"] += 1
            return default_hooks.allreduce_hook(state, bucket)

        model.register_comm_hook(None, counting)
        # DDP rebuilds its buckets after the first iteration: warm up once, uncounted.
        model(micro_batch(rank, 500, 2)["x"]).sum().backward()
        model.zero_grad(set_to_none=True)
        model(micro_batch(rank, 501, 2)["x"]).sum().backward()
        model.zero_grad(set_to_none=True)
        calls["grad"] = 0
    else:
        model = wrap(model, "fsdp")
        for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
            if hasattr(dist, name):
                setattr(dist, name, counted(getattr(dist, name), "grad", False))
    for name in ("all_reduce", "all_gather_single", "all_gather_into_tensor"):
        if hasattr(dist, name):
            setattr(dist, name, counted(getattr(dist, name), "tiny", True))
    opt = make_optimizer(model.parameters())
    data = rank_data(rank, layout)
    if loop == "naive":  # syncs every micro-batch: the loop fullbatch replaces
        for w in range(len(data) // k):
            for micro in data[w * k : (w + 1) * k]:
                loss_sum, n = fb.cross_entropy_sum(model(micro["x"]), micro["y"])
                (loss_sum / max(int(n), 1) / k).backward()
            opt.step()
            opt.zero_grad()
        windows = len(data) // k
    else:
        options = {"fsdp_sync": "micro_batch"} if loop == "micro_batch" else {}
        windows = len(fit(model, data, k, **options))
    grad_before = calls["grad"]
    # One plain synced backward measures the bucket / FSDP-group count.
    out = model(data[0]["x"]).sum()
    out.backward()
    return {
        **calls,
        "grad": grad_before,
        "per_backward": calls["grad"] - grad_before,
        "windows": windows,
        "k": k,
    }


def discard_then_train(rank: int, world: int, only_rank0: bool) -> list[Any]:
    """Window 0 is discarded (on every rank, or only on rank 0); later windows train."""
    layout = [[2, 3, 2, 2], [3, 2, 1, 2]]
    model = wrap(make_model(), "ddp")
    opt = make_optimizer(model.parameters())
    out = []
    with fb.Accumulator(model, opt, micro_batches=2) as acc:
        for window in acc.windows(rank_data(rank, layout)):
            for micro in window:
                loss_sum, n = fb.cross_entropy_sum(model(micro["x"]), micro["y"])
                window.backward(loss_sum, n)
            if window.index == 0 and (rank == 0 or not only_rank0):
                window.discard()
                out.append(None)
                continue
            out.append(window.step().steps)
    out.append(_full_params(model))
    return out


def foreign_parameter(rank: int, world: int) -> None:
    """An optimizer parameter outside the DDP model: its gradient would not be reduced."""
    model = wrap(make_model(), "ddp")
    temperature = nn.Parameter(torch.ones((), dtype=torch.float64))
    opt = make_optimizer([*model.parameters(), temperature])
    fb.Accumulator(model, opt, micro_batches=2)


def split_padding(rank: int, world: int) -> dict[str, Any]:
    """FSDP2 with micro_batch_size=2: rank 0 holds 8 rows, rank 1 holds 5 (one window each)."""
    batch = micro_batch(rank, 0, [8, 5][rank])
    model = wrap(make_model(), "fsdp")
    opt = make_optimizer(model.parameters())
    seen = []
    with fb.Accumulator(model, opt, micro_batch_size=2) as acc:
        for window in acc.windows([batch]):
            for micro in window:
                seen.append((window.is_padding, micro["x"].shape[0]))
                loss_sum, n = fb.cross_entropy_sum(model(micro["x"]), micro["y"])
                window.backward(loss_sum, n)
            window.step()
    return {"seen": seen, "params": _full_params(model)}

"""Composed meshes on gloo CPU ranks: fullbatch and hand-written loops against the float64
full batch, the probe's verdict on each hand loop, and what the window's count reduction costs.

    PYTHONPATH=src python benchmarks/meshes.py            # the table and the cost rows
    PYTHONPATH=src python benchmarks/meshes.py --cost-only

Meshes: tensor parallelism alone ("tp"=2, 2 ranks) and FSDP2 on "dp" x TP on "tp" (2 x 2,
4 ranks). Model: Linear(6, 16), Tanh, Linear(16, 4), float64, ColwiseParallel then
RowwiseParallel (its bias replicated over "tp"). The two "dp" indices read different numbers
of rows and of labelled items per micro-batch; the ranks of a "tp" group read the same. K=3
micro-batches per window, 2 windows, SGD (lr 0.5, momentum 0.9); with a clip of 0.2 (it
bites on every window) or none. Error: max over ranks and windows of
``max|p - p_ref| / max|p_ref|`` against one float64 full-batch step per window.

Hand loops, written the way people do (each in ``HAND``):

- ``mean/K``: each micro-batch's mean loss divided by K (a mean of means), FSDP2's average;
- ``per-rank count``: ``loss_sum / n_rank`` with n_rank this rank's window count, FSDP2's
  average over "dp" (right only when every rank holds as many items);
- ``count over dp x tp``: ``loss_sum / N`` with N the count all-reduced over the whole
  world (every item counted once per "tp" rank) and FSDP2's division turned off.

Each clips with ``torch.nn.utils.clip_grad_norm_`` (DTensor-aware: the full norm). The probe
column runs the same hand loop inside ``fb.probe(objective=...)`` for its first window and
prints the verdict (RIGHT/WRONG) or "unsupported" with the reason's first words.

Cost rows: per window, the seconds of fullbatch's one reduction (the window's numbers stacked,
one all-reduce, one blocking ``tolist()``) against the hand loop's count reduction (one
all-reduce of the count whose result stays a tensor, the denominator of the loss: on a GPU
it is waited for on the device, never on the host), over 2 and 4 gloo ranks, and a model of
how it grows with the ranks (labelled as such: a latency-bound tiny all-reduce).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import fullbatch as fb

IN, HIDDEN, OUT = 6, 16, 4
K = 3
LAYOUT = [[3, 1, 4, 2, 5, 2], [2, 6, 1, 3, 2, 2]]  # rows per micro-batch, per "dp" index
CLIPS = [None, 0.2]
HAND = ["mean/K", "per-rank count", "count over dp x tp"]


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT)).double()


def micro_batch(d: int, i: int, rows: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1009 * d + i)
    x = torch.randn(rows, IN, generator=g, dtype=torch.float64)
    y = torch.randint(0, OUT, (rows,), generator=g)
    y[torch.rand(rows, generator=g) < 0.25] = -100
    return {"x": x, "y": y}


def data(d: int) -> list[dict[str, torch.Tensor]]:
    return [micro_batch(d, i, rows) for i, rows in enumerate(LAYOUT[d])]


def reference(dp: int, clip: float | None) -> list[torch.Tensor]:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    out = []
    for w in range(len(LAYOUT[0]) // K):
        micro = [m for d in range(dp) for m in data(d)[w * K : (w + 1) * K]]
        x, y = torch.cat([m["x"] for m in micro]), torch.cat([m["y"] for m in micro])
        n = int((y != -100).sum())
        opt.zero_grad()
        (nn.functional.cross_entropy(model(x), y, reduction="sum") / n).backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        out.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return out


def build(world: int) -> tuple[nn.Module, Any, int]:
    """The parallelized model, the world's mesh, and this rank's "dp" index."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    if world == 2:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        return parallelize_module(make_model(), mesh, plan), mesh, 0
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = fully_shard(parallelize_module(make_model(), mesh["tp"], plan), mesh=mesh["dp"])
    return model, mesh, dist.get_rank() // 2


def full(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().full_tensor().reshape(-1) for p in model.parameters()])


def error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(float((g - w).abs().max() / w.abs().max()) for g, w in zip(got, want, strict=True))


def run_fullbatch(world: int, clip: float | None) -> list[torch.Tensor]:
    model, _, d = build(world)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    out = []
    with fb.Accumulator(model, opt, micro_batches=K, max_grad_norm=clip) as acc:
        for window in acc.windows(data(d)):
            for micro in window:
                window.backward(*fb.cross_entropy_sum(model(micro["x"]), micro["y"]))
            window.step()
            out.append(full(model))
    return out


def objective(model: nn.Module, micro: dict) -> Any:
    return fb.cross_entropy_sum(model(micro["x"]), micro["y"])


def run_hand(world: int, clip: float | None, hand: str, probe: bool) -> Any:
    model, _, d = build(world)
    if hand == "count over dp x tp" and world > 2:
        model.set_gradient_divide_factor(1.0)  # the loop divides by the global count itself
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    micro_batches = data(d)
    out: list[torch.Tensor] = []
    windows = len(micro_batches) // K
    ctx = fb.probe(model, opt, objective=objective, windows=1) if probe else None
    try:
        if ctx is not None:
            ctx.__enter__()
        for w in range(windows if not probe else 1):
            part = micro_batches[w * K : (w + 1) * K]
            local = sum(int((m["y"] != -100).sum()) for m in part)
            n = torch.tensor(float(local), dtype=torch.float64)
            if hand == "count over dp x tp":
                dist.all_reduce(n)  # over every rank: each item once per "tp" rank
            for micro in part:
                x, y = micro["x"], micro["y"]
                if hand == "mean/K":
                    loss = nn.functional.cross_entropy(model(x), y) / K
                else:
                    loss = nn.functional.cross_entropy(model(x), y, reduction="sum") / n
                loss.backward()
            if clip is not None:
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
            out.append(full(model))
    except Exception as exc:  # the probe's refusal, on every rank alike
        return _unsupported(str(exc))
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
    if ctx is not None:
        report = ctx.report
        if report.windows:
            return "RIGHT" if report.ok else "WRONG"
        return _unsupported(report.problems[0] if report.problems else "nothing checked")
    return out


def _unsupported(reason: str) -> str:
    """ "unsupported" and the reason's first words (the probe's own prefix dropped)."""
    reason = reason.removeprefix("unsupported: ").split(":")[0].split(" (")[0]
    if len(reason) > 48:
        reason = reason[:48].rsplit(" ", 1)[0] + " ..."
    return f"unsupported ({reason})"


def table_rank(rank: int, world: int, store: str, queue: Any) -> None:
    _init(rank, world, store)
    warnings.simplefilter("ignore")
    rows = []
    for clip in CLIPS:
        dp = 1 if world == 2 else 2
        ref = reference(dp, clip)
        fb_err = error(run_fullbatch(world, clip), ref)
        for hand in HAND:
            if world == 2 and hand == "count over dp x tp":
                continue
            hand_err = error(run_hand(world, clip, hand, probe=False), ref)
            verdict = run_hand(world, clip, hand, probe=True)
            rows.append((clip, fb_err, hand, hand_err, verdict))
    queue.put((rank, rows))
    dist.destroy_process_group()


def cost_rank(rank: int, world: int, store: str, queue: Any) -> None:
    """Seconds per window of fullbatch's reduction and of the hand loop's count reduction."""
    _init(rank, world, store)
    reps = 100
    times: dict[str, list[float]] = {"fullbatch": [], "hand": []}
    slots = torch.zeros(7, dtype=torch.float64)
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        summed = slots.clone()
        dist.all_reduce(summed)
        summed.tolist()  # the one blocking read of the window's numbers
        times["fullbatch"].append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        count = torch.ones((), dtype=torch.float64)
        work = dist.all_reduce(count, async_op=True)
        work.wait()  # on CPU the host waits; on a GPU the loss would wait on the device
        times["hand"].append(time.perf_counter() - t0)
    queue.put((rank, {k: statistics.median(v) for k, v in times.items()}))
    dist.destroy_process_group()


def _init(rank: int, world: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )


def launch(fn: Any, world: int) -> list[Any]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=fn, args=(r, world, store, queue)) for r in range(world)]
        for p in procs:
            p.start()
        got = dict(queue.get(timeout=600) for _ in range(world))
        for p in procs:
            p.join(timeout=60)
    return [got[r] for r in range(world)]


def table() -> None:
    print(
        "| mesh | clip | fullbatch error | hand loop | hand-loop error | probe on the hand loop |"
    )
    print("|---|---|---|---|---|---|")
    for world, mesh in ((2, "tp=2"), (4, "FSDP2 dp=2 x TP tp=2")):
        per_rank = launch(table_rank, world)
        for i, (clip, _, hand, _, verdict) in enumerate(per_rank[0]):
            fb_err = max(r[i][1] for r in per_rank)
            hand_err = max(r[i][3] for r in per_rank)
            verdicts = {r[i][4] for r in per_rank}
            shown = verdict if len(verdicts) == 1 else " / ".join(sorted(verdicts))
            print(f"| {mesh} | {clip or '-'} | {fb_err:.1e} | {hand} | {hand_err:.1e} | {shown} |")


def cost(worlds: tuple[int, ...]) -> None:
    print("\n| ranks | fullbatch: all-reduce + blocking read (us) | hand: count all-reduce (us) |")
    print("|---|---|---|")
    rows = {}
    for world in worlds:
        per_rank = launch(cost_rank, world)
        fb_us = max(r["fullbatch"] for r in per_rank) * 1e6
        hand_us = max(r["hand"] for r in per_rank) * 1e6
        rows[world] = (fb_us, hand_us)
        print(f"| {world} | {fb_us:.0f} | {hand_us:.0f} |")
    # A model, not a measurement: a tiny all-reduce is latency-bound, one latency per hop;
    # a ring takes 2 (P - 1) hops, a tree 2 log2(P). The hop latency is read off the first
    # row (2 ranks: 2 hops either way). On a GPU the blocking read also waits for the device
    # queue (the tail of the window's last backward); CPU ranks have no queue to wait for.
    fb_us, hand_us = rows[worlds[0]]
    hop = hand_us / 2
    print(f"\nmodel (not measured): one tiny all-reduce per window either way, {hop:.0f} us per")
    extra = fb_us - hand_us
    print(
        f"hop (read off {worlds[0]} ranks); fullbatch's blocking read measured {extra:.0f} us more"
    )
    print("| P | ring 2(P-1) hops (ms) | tree 2 log2(P) hops (ms) |")
    print("|---|---|---|")
    for p in (8, 64, 256):
        ring, tree = 2 * (p - 1) * hop / 1e3, 2 * math.log2(p) * hop / 1e3
        print(f"| {p} | {ring:.1f} | {tree:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cost-only", action="store_true")
    parser.add_argument("--cost-ranks", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    if not args.cost_only:
        table()
    cost(tuple(args.cost_ranks))


if __name__ == "__main__":
    sys.exit(main())

"""The MoE load-balancing loss under accumulation: five recipes against one full batch.

Tiny random Mixtral, Qwen3-MoE and OLMoE (transformers, float64, 2 layers, 4 experts, top-2,
``router_aux_loss_coef`` 0.25), one window of 8 right-padded rows cut into uneven
micro-batches (1 rank: 1+3+2+2 rows; 2 gloo DDP ranks: 1+3 and 2+1+1). The reference is
written here: one forward of the whole window, token-mean cross-entropy plus the pooled
load-balancing loss of the whole window in float64 (transformers' definition). Recipes:

- ``stock loss/GA``: each micro-batch's ``out.loss`` from the model given its labels (its own
  CE mean + coef · its own aux) divided by the rank's micro-batch count, DDP averaging ranks;
- ``stock num_items_in_batch``: the Trainer's: ``out.loss`` from the model given its labels
  and ``num_items_in_batch`` (the window's tokens over all ranks: CE exact) times the rank
  count, so coef · the aux loss of every micro-batch is added undivided;
- ``per-micro-batch aux``: exact CE plus the mean of the micro-batches' own aux losses;
- ``running mean``: exact CE plus the mean over micro-batches of an aux loss whose ``f`` counts
  micro-batches 1..k of every rank (Megatron-Core's ``global_aux_loss``, torchtitan#4772);
- ``fullbatch exact``: ``fb.Accumulator`` with ``window.stats`` (``fb.moe``).

Each row gives the step's gradient error ``‖g - g*‖ / ‖g*‖`` and the aux term's alone. The
pre-pass cost, on rank 0, in a second table: its time beside the window's training (forwards,
backwards and the step; medians over ``--reps`` windows after one untimed window, SGD with
lr 0 so every window is the same), and its peak memory beside the training's: the most bytes
torch's CPU allocator held above its level before each phase, read from ``torch.profiler``'s
allocation events (``benchmarks/_alloc_peak.py``; tensor storage, the untimed window).

Run: ``PYTHONPATH=src python benchmarks/moe_window_stats.py [--ranks 1 2] [--reps 5]`` (about
a minute on 2 CPU cores).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import fullbatch as fb

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _alloc_peak import peak_bytes

from _moe_cases import COEF, FAMILIES, TOP_K, aux64, forward, make_moe, moe_rows

LENGTHS = [7, 3, 5, 6, 2, 7, 4, 5]
SPLITS = {1: [[1, 3, 2, 2]], 2: [[1, 3], [2, 1, 1]]}
RECIPES = ("stock loss/GA", "stock num_items_in_batch", "per-micro-batch aux", "running mean")


def _window() -> dict[str, torch.Tensor]:
    return moe_rows(LENGTHS, seed=11)


def _micros(world: int, rank: int) -> list[dict[str, torch.Tensor]]:
    rows, sizes = _window(), SPLITS[world]
    start = sum(sum(s) for s in sizes[:rank])
    out = []
    for size in sizes[rank]:
        out.append({k: v[start : start + size] for k, v in rows.items()})
        start += size
    return out


def _counts(out: Any, micro: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return fb.moe.router_counts(
        out.router_logits, top_k=TOP_K, attention_mask=micro["attention_mask"]
    )


def _aux(out: Any, micro: dict[str, torch.Tensor], counts: Any) -> torch.Tensor:
    return fb.moe.load_balancing(out.router_logits, counts, attention_mask=micro["attention_mask"])


def _all(value: torch.Tensor, world: int) -> torch.Tensor:
    if world > 1:
        value = value.clone()
        dist.all_reduce(value)
    return value


def _grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
            for p in model.parameters()
        ]
    )


def _recipe(name: str, family: str, world: int, rank: int, with_ce: bool) -> torch.Tensor:
    """The gradient one recipe applies (DDP-averaged over ranks, as a DDP step would)."""
    model = make_moe(family)
    ddp = DDP(model, find_unused_parameters=True) if world > 1 else model
    micros = _micros(world, rank)
    tokens = _all(torch.tensor(float(sum(fb.count_tokens(m["labels"]) for m in micros))), world)
    n_micro = _all(torch.tensor(float(len(micros))), world)
    # Running counts of micro-batches 1..k over every rank (Megatron reduces each step's).
    with torch.no_grad():
        mine = [_counts(forward(model, m), m) for m in micros]
    most = len(micros)
    running = []
    experts = torch.zeros(mine[0]["experts"].shape, dtype=torch.float64)
    rows = torch.zeros((), dtype=torch.float64)
    steps = [len(_micros(world, r)) for r in range(world)]
    for k in range(max(steps)):
        if k < most:
            experts, rows = experts + mine[k]["experts"], rows + mine[k]["rows"]
        running.append({"experts": _all(experts, world), "rows": _all(rows, world)})
    for k, micro in enumerate(micros):
        # DDP decides at forward time whether the backward syncs: both under no_sync but the last.
        quiet = world > 1 and k < len(micros) - 1
        with ddp.no_sync() if quiet else contextlib.nullcontext():  # type: ignore[operator]
            _backward(name, ddp, micro, k, len(micros), mine, running, tokens, n_micro, with_ce)
    return _grads(model)


def _backward(
    name: str,
    ddp: Any,
    micro: dict[str, torch.Tensor],
    k: int,
    count: int,
    mine: list[Any],
    running: list[Any],
    tokens: torch.Tensor,
    n_micro: torch.Tensor,
    with_ce: bool,
) -> None:
    world = dist.get_world_size() if dist.is_initialized() else 1
    if name.startswith("stock"):  # the model's own loss and aux loss, as transformers computes
        items = {"num_items_in_batch": tokens} if name == "stock num_items_in_batch" else {}
        out = ddp(**micro, output_router_logits=True, **items)
        own = out.loss if with_ce else COEF * out.aux_loss  # CE + coef · its own aux
        # loss/GA: over the rank's micro-batches; the Trainer's num_items_in_batch: * world
        (own / count if name == "stock loss/GA" else own * world).backward()
        return
    out = forward(ddp, micro)
    ce_sum, _ = fb.causal_lm_loss(out.logits, micro["labels"])
    ce = ce_sum / tokens * world * with_ce  # DDP averages: the Trainer's * world
    counts = mine[k] if name == "per-micro-batch aux" else running[k]  # or the running mean's
    (ce + COEF * _aux(out, micro, counts) * world / n_micro).backward()


def _engine(family: str, world: int, rank: int, lr: float) -> tuple[Any, Any, list[Any]]:
    """fullbatch's loop pieces: the model, an Accumulator over it, this rank's micro-batches."""
    model = make_moe(family)
    ddp = DDP(model, find_unused_parameters=True) if world > 1 else model
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    micros = _micros(world, rank)
    counts_fn = {"tokens": lambda m: fb.count_tokens(m["labels"])}
    return model, fb.Accumulator(ddp, opt, micro_batches=len(micros), counts=counts_fn), micros


def _routing(acc: Any) -> Any:
    """The window statistic: one micro-batch's routing counts (under ``window.stats``)."""
    return lambda micro: _counts(forward(acc.model, micro), micro)


def _train(acc: Any, window: Any, counts: Any, with_ce: bool = True) -> None:
    """Each micro-batch's share: CE over the window's tokens + coef · its aux term."""
    for micro in window:
        out = forward(acc.model, micro)
        ce, _ = fb.causal_lm_loss(out.logits, micro["labels"])
        window.backward(ce / window.totals["tokens"] * with_ce + COEF * _aux(out, micro, counts))


def _exact(family: str, world: int, rank: int, with_ce: bool) -> torch.Tensor:
    """fullbatch: the window statistic's pre-pass, then each micro-batch's share; SGD(lr=1)'s
    parameter change is the applied gradient."""
    model, acc, micros = _engine(family, world, rank, lr=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    for window in acc.windows(micros):
        _train(acc, window, window.stats(_routing(acc)), with_ce)
        window.step()
    return torch.cat(
        [(b - p.detach()).flatten() for b, p in zip(before, model.parameters(), strict=True)]
    )


def _cost(family: str, world: int, rank: int, reps: int) -> tuple[float, float, int, int]:
    """Median seconds of the pre-pass and of the rest of a window (forwards, backwards, step)
    over ``reps`` windows, and the peak allocator bytes of each in one untimed window first."""
    _, acc, micros = _engine(family, world, rank, lr=0.0)  # lr 0: every window the same
    routing = _routing(acc)
    peaks, pre, rest = [0, 0], [], []
    for i, window in enumerate(acc.windows(micros * (reps + 1))):
        began = time.perf_counter()
        if i == 0:
            counts, peaks[0] = peak_bytes(lambda w=window: w.stats(routing))
            peaks[1] = peak_bytes(lambda w=window, c=counts: _train(acc, w, c))[1]
        else:
            _train(acc, window, window.stats(routing))
        stats = window.step()
        if i > 0:
            pre.append(stats.stats_seconds)
            rest.append(time.perf_counter() - began - stats.stats_seconds)
    return statistics.median(pre), statistics.median(rest), peaks[0], peaks[1]


def reference(family: str, with_ce: bool) -> torch.Tensor:
    model, rows = make_moe(family), _window()
    out = forward(model, rows)
    ce = F.cross_entropy(
        out.logits[:, :-1].reshape(-1, out.logits.shape[-1]),
        rows["labels"][:, 1:].reshape(-1),
        ignore_index=-100,
    )
    (ce * with_ce + COEF * aux64(out.router_logits, rows["attention_mask"])).backward()
    return _grads(model)


def _rank(rank: int, world: int, store: str, reps: int, out: Any) -> None:
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    found: dict[tuple[str, str, Any], Any] = {}
    for family in FAMILIES:
        for with_ce in (True, False):
            for name in RECIPES:
                found[family, name, with_ce] = _recipe(name, family, world, rank, with_ce)
            found[family, "fullbatch exact", with_ce] = _exact(family, world, rank, with_ce)
        found[family, "cost", None] = _cost(family, world, rank, reps)
    if rank == 0:
        out.put(pickle.dumps(found))  # bytes: a tensor's shared memory dies with the rank
    if world > 1:
        dist.destroy_process_group()


def _run(world: int, reps: int) -> dict[tuple[str, str, Any], Any]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_rank, args=(r, world, store, reps, queue)) for r in range(world)
        ]
        for p in procs:
            p.start()
        found = pickle.loads(queue.get(timeout=1800))
        for p in procs:
            p.join(timeout=60)
    return found


def _err(got: torch.Tensor, want: torch.Tensor) -> str:
    return f"{float((got - want).norm() / want.norm()):.1e}"


def _arg(name: str, default: list[int]) -> list[int]:
    """``--name N [N ...]`` from the command line (numbers up to the next ``--``)."""
    if name not in sys.argv:
        return default
    out = []
    for value in sys.argv[sys.argv.index(name) + 1 :]:
        if value.startswith("--"):
            break
        out.append(int(value))
    return out


def main() -> None:
    """``--ranks 1 2`` (default): which rank counts to run; ``--reps 5``: timed windows."""
    worlds, (reps,) = _arg("--ranks", [1, 2]), _arg("--reps", [5])
    torch.set_num_threads(1)
    costs = []
    print("| model | ranks | recipe | step grad error | aux grad error |")
    print("|---|---|---|---|---|")
    for world in worlds:
        found = _run(world, reps)
        for family in FAMILIES:
            step, aux = reference(family, True), reference(family, False)
            for name in (*RECIPES, "fullbatch exact"):
                got, got_aux = found[family, name, True], found[family, name, False]
                print(f"| {family} | {world} | {name} | {_err(got, step)} | {_err(got_aux, aux)} |")
            costs.append((family, world, *found[family, "cost", None]))
    print()
    print(
        "| model | ranks | pre-pass time | training time | time ratio "
        "| pre-pass peak | training peak | memory ratio |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for family, world, pre, train, pre_peak, train_peak in costs:
        times = f"{pre * 1e3:.1f} ms | {train * 1e3:.1f} ms | {pre / train:.2f}x"
        peaks = f"{pre_peak / 1024:.0f} KiB | {train_peak / 1024:.0f} KiB"
        print(f"| {family} | {world} | {times} | {peaks} | {pre_peak / train_peak:.2f}x |")


if __name__ == "__main__":
    main()

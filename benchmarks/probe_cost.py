"""What ``fb.probe`` costs: time and peak memory of a probed window vs an unprobed one.

    PYTHONPATH=src python benchmarks/probe_cost.py              # about 4 minutes on 2 CPU cores
    PYTHONPATH=src python benchmarks/probe_cost.py --rounds 5
    PYTHONPATH=src python benchmarks/probe_cost.py --engine fsdp2 --ranks 2
    PYTHONPATH=src python benchmarks/probe_cost.py --engine deepspeed --stage 3 --offload

A Llama built from a config (hidden 256, 4 layers, vocabulary 4096: 5.3M float32 parameters,
21 MiB of gradient), windows of K=8 micro-batches of 4 rows x 128 tokens, a hand-written loop
(``loss_sum / N``, SGD). Four runs, each in a fresh process with this interpreter:

- **unprobed**: 6 windows;
- **probed**: 6 windows, all probed (``fb.probe(objective="causal_lm", windows=6)``): each
  micro-batch differentiated on its own forward's graph (``fullbatch._probe._early``);
- **replayed**: the same with a callable objective that computes the same loss, so each
  micro-batch's forward is replayed at ``step()`` (a callable runs the model itself);
- **after**: 1 probed window, then 5 unprobed ones with the probe's hooks gone.

Each run is repeated in ``--rounds`` fresh processes, in alternating order (unprobed, probed,
replayed, after; then the reverse; ...), so a busy machine slows every run alike; the table
gives the median over rounds, and the range of each round's ratio to that round's unprobed
run. Per process: the median time of windows 2-6 (the first warms up), as wall time and as the
process's CPU time (one thread: the CPU time leaves out what other jobs on a shared machine
take), and the process's peak resident memory (``ru_maxrss``) minus its resident memory before
the first window. The probe's extra work per window: one backward per micro-batch (a replayed
one: a forward and a backward), one more for the rounding band, the gradient-sized reference
buffer, and 16384 sampled float64 coordinates per micro-batch.

``--engine deepspeed`` (ZeRO ``--stage``, ``--offload``: the optimizer on the CPU; float32,
``gradient_accumulation_steps=K``, the loop's ``engine.backward(loss_sum · world / N,
scale_wrt_gas=False)``) and ``--engine fsdp2`` (``fully_shard`` on each decoder layer and the
root, a 1-D mesh) run the same windows on ``--ranks`` gloo processes on this CPU (a FileStore:
no port), each rank with its own micro-batches; rank 0's time and peak memory are reported.
There the reference is always replayed (the engines' parameters are not plain), the probe also
gathers the applied gradient whole (DeepSpeed's partitions, FSDP2's ``full_tensor()``) and its
replays run the engine's hooks (parameter all-gathers).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

import fullbatch as fb

K, ROWS, TOKENS, WINDOWS = 8, 4, 128, 6
MODES = ("unprobed", "probed", "replayed", "after")
ENGINES = ("plain", "deepspeed", "fsdp2")


def model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=TOKENS,
        tie_word_embeddings=False, attention_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).train()


def window_data(w: int, rank: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 * rank + w)
    out = []
    for _ in range(K):
        ids = torch.randint(4096, (ROWS, TOKENS), generator=g)
        lengths = torch.randint(TOKENS // 4, TOKENS + 1, (ROWS,), generator=g)
        labels = ids.masked_fill(torch.arange(TOKENS) >= lengths[:, None], -100)
        out.append({"input_ids": ids, "labels": labels})
    return out


def train_window(
    net: torch.nn.Module, opt: Any, data: list[dict], engine: str = "plain"
) -> tuple[float, float]:
    """One window's wall time and this process's CPU time (one thread: what other jobs on a
    shared machine take away from the wall time, they leave out of the CPU time). ``opt`` is the
    optimizer, or the DeepSpeed engine (then ``net`` is too)."""
    start, cpu = time.perf_counter(), time.process_time()
    total = torch.tensor(float(sum(int((m["labels"][:, 1:] != -100).sum()) for m in data)))
    world = 1
    if engine != "plain":
        import torch.distributed as dist

        dist.all_reduce(total)  # the window's items over every rank
        world = dist.get_world_size()  # DeepSpeed and FSDP2 average over the ranks
    for micro in data:
        loss_sum, _ = fb.causal_lm_loss(net(input_ids=micro["input_ids"]).logits, micro["labels"])
        if engine == "deepspeed":
            opt.backward(loss_sum * world / total, scale_wrt_gas=False)
            opt.step()  # DeepSpeed steps at the window's boundary
        else:
            (loss_sum * world / total).backward()
    if engine != "deepspeed":
        opt.step()
        opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start, time.process_time() - cpu


def replayed_objective(net: torch.nn.Module, micro: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``causal_lm`` as a callable: the probe replays each micro-batch's forward with it."""
    return fb.causal_lm_loss(net(input_ids=micro["input_ids"]).logits, micro["labels"])


def _sharded(net: torch.nn.Module, engine: str, options: dict[str, Any]) -> tuple[Any, Any]:
    """The model and what steps it: a DeepSpeed engine (twice), or FSDP2 and its optimizer."""
    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in net.model.layers:
            fully_shard(layer)
        fully_shard(net)
        return net, torch.optim.SGD(net.parameters(), lr=0.01)
    import deepspeed

    zero: dict[str, Any] = {"stage": options["stage"]}
    if options["offload"]:
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": ROWS,
        "gradient_accumulation_steps": K,
        "train_batch_size": ROWS * K * options["ranks"],
        "gradient_clipping": 0.0,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
    }
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    ds, *_ = deepspeed.initialize(model=net, optimizer=opt, config=config)
    return ds, ds


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run(mode: str, options: dict[str, Any]) -> dict[str, float]:
    torch.set_num_threads(1)
    engine, rank = options["engine"], options.get("rank", 0)
    if engine != "plain":
        _join(options)
    net: Any = model()
    opt: Any = torch.optim.SGD(net.parameters(), lr=0.01)
    if engine != "plain":
        net, opt = _sharded(net, engine, options)
    data = [window_data(w, rank) for w in range(WINDOWS)]
    before = rss_mib()
    probed = {"unprobed": 0, "probed": WINDOWS, "replayed": WINDOWS, "after": 1}[mode]
    objective = replayed_objective if mode == "replayed" else "causal_lm"
    times = []
    if probed:
        with fb.probe(objective=objective, windows=probed) as probe:
            times = [train_window(net, opt, d, engine) for d in data]
        assert len(probe.report.windows) == probed and probe.report.ok, str(probe.report)
    else:
        times = [train_window(net, opt, d, engine) for d in data]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    size = model()  # the whole model's sizes (the engine's parameters may be shards)
    grad = sum(p.numel() * p.element_size() for p in size.parameters()) / 2**20
    params = sum(p.numel() for p in size.parameters()) / 1e6
    return {"median_s": statistics.median(t for t, _ in times[1:]),
            "cpu_s": statistics.median(c for _, c in times[1:]), "extra_peak_mib": peak - before,
            "gradient_mib": grad, "params_m": params}  # fmt: skip


def _join(options: dict[str, Any]) -> None:
    """This rank's gloo group (a FileStore) and the environment DeepSpeed reads on a CPU."""
    import datetime

    import torch.distributed as dist

    rank, world = options["rank"], options["ranks"]
    os.environ.update(
        DS_ACCELERATOR="cpu", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="1",
    )  # fmt: skip
    os.environ.pop("LOCAL_SIZE", None)  # DeepSpeed's shared-memory all-reduce stays off
    dist.init_process_group(
        "gloo", init_method=f"file://{options['store']}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )  # fmt: skip


def _measure(mode: str, options: dict[str, Any]) -> dict[str, float]:
    """One run in fresh processes (one per rank); rank 0's numbers."""
    ranks = 1 if options["engine"] == "plain" else options["ranks"]
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for rank in range(ranks):
            worker = json.dumps({**options, "rank": rank, "store": os.path.join(tmp, "store")})
            command = [sys.executable, __file__, mode, worker]
            quiet = subprocess.DEVNULL
            procs.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=quiet, text=True))
        outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a {mode} rank failed: rerun with stderr shown")
    return dict(json.loads(outs[0].strip().splitlines()[-1]))


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] in MODES:
        print(json.dumps(run(sys.argv[1], json.loads(sys.argv[2]))))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per run (3)")
    parser.add_argument("--engine", choices=ENGINES, default="plain")
    parser.add_argument("--ranks", type=int, default=2, help="gloo ranks of deepspeed/fsdp2")
    parser.add_argument("--stage", type=int, default=2, help="DeepSpeed ZeRO stage (2)")
    parser.add_argument("--offload", action="store_true", help="DeepSpeed offload_optimizer")
    args = parser.parse_args()
    options = {k: getattr(args, k) for k in ("engine", "ranks", "stage", "offload")}
    rounds = args.rounds
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for r in range(rounds):  # ABC, CBA, ABC, ...: no run always goes first on a busy machine
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            results[mode].append(_measure(mode, options))
    base = results["unprobed"][0]
    where = "one process"
    if args.engine == "deepspeed":
        where = f"DeepSpeed ZeRO-{args.stage}{' offload' if args.offload else ''}"
    elif args.engine == "fsdp2":
        where = "FSDP2 (fully_shard per layer)"
    if args.engine != "plain":
        where += f", {args.ranks} gloo ranks (rank 0 reported)"
    print(
        f"{base['params_m']:.1f}M float32 parameters ({base['gradient_mib']:.0f} MiB of gradient), "
        f"windows of {K} micro-batches of {ROWS}x{TOKENS} tokens, 1 thread, {rounds} rounds, "
        f"{where}"
    )
    print(
        f"{'run':<10} {'clock':<5} {'window (median)':>16} {'vs unprobed':>12} "
        f"{'(per round)':>16} {'peak memory above start':>25}"
    )
    peaks = {m: statistics.median(r["extra_peak_mib"] for r in rs) for m, rs in results.items()}
    for mode in MODES:
        for clock, key in (("wall", "median_s"), ("cpu", "cpu_s")):
            times = {m: [r[key] for r in rs] for m, rs in results.items()}
            ratios = [t / u for t, u in zip(times[mode], times["unprobed"], strict=True)]
            median = statistics.median(times[mode])
            peak = f"{peaks[mode]:>20.0f} MiB" if clock == "wall" else ""
            print(
                f"{mode:<10} {clock:<5} {median:>14.3f} s "
                f"{median / statistics.median(times['unprobed']):>11.2f}x "
                f"{min(ratios):>9.2f}-{max(ratios):.2f}x {peak}"
            )
    extra = peaks["probed"] - peaks["unprobed"]
    print(
        f"the probe's extra peak: {extra:.0f} MiB = {extra / base['gradient_mib']:.2f} x the "
        "gradient's size (medians over rounds)"
    )


if __name__ == "__main__":
    main()

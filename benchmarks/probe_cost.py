"""What ``fb.probe`` costs: time and peak memory of a probed window vs an unprobed one.

    PYTHONPATH=src python benchmarks/probe_cost.py              # about 4 minutes on 2 CPU cores
    PYTHONPATH=src python benchmarks/probe_cost.py --rounds 5

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
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

import fullbatch as fb

K, ROWS, TOKENS, WINDOWS = 8, 4, 128, 6
MODES = ("unprobed", "probed", "replayed", "after")


def model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=TOKENS,
        tie_word_embeddings=False, attention_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).train()


def window_data(w: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(w)
    out = []
    for _ in range(K):
        ids = torch.randint(4096, (ROWS, TOKENS), generator=g)
        lengths = torch.randint(TOKENS // 4, TOKENS + 1, (ROWS,), generator=g)
        labels = ids.masked_fill(torch.arange(TOKENS) >= lengths[:, None], -100)
        out.append({"input_ids": ids, "labels": labels})
    return out


def train_window(
    net: torch.nn.Module, opt: torch.optim.Optimizer, data: list[dict]
) -> tuple[float, float]:
    """One window's wall time and this process's CPU time (one thread: what other jobs on a
    shared machine take away from the wall time, they leave out of the CPU time)."""
    start, cpu = time.perf_counter(), time.process_time()
    total = sum(int((m["labels"][:, 1:] != -100).sum()) for m in data)
    for micro in data:
        loss_sum, _ = fb.causal_lm_loss(net(input_ids=micro["input_ids"]).logits, micro["labels"])
        (loss_sum / total).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start, time.process_time() - cpu


def replayed_objective(net: torch.nn.Module, micro: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``causal_lm`` as a callable: the probe replays each micro-batch's forward with it."""
    return fb.causal_lm_loss(net(input_ids=micro["input_ids"]).logits, micro["labels"])


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run(mode: str) -> dict[str, float]:
    torch.set_num_threads(1)
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    data = [window_data(w) for w in range(WINDOWS)]
    before = rss_mib()
    probed = {"unprobed": 0, "probed": WINDOWS, "replayed": WINDOWS, "after": 1}[mode]
    objective = replayed_objective if mode == "replayed" else "causal_lm"
    times = []
    if probed:
        with fb.probe(objective=objective, windows=probed) as probe:
            times = [train_window(net, opt, d) for d in data]
        assert len(probe.report.windows) == probed and probe.report.ok, str(probe.report)
    else:
        times = [train_window(net, opt, d) for d in data]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    grad = sum(p.numel() * p.element_size() for p in net.parameters()) / 2**20
    params = sum(p.numel() for p in net.parameters()) / 1e6
    return {"median_s": statistics.median(t for t, _ in times[1:]),
            "cpu_s": statistics.median(c for _, c in times[1:]), "extra_peak_mib": peak - before,
            "gradient_mib": grad, "params_m": params}  # fmt: skip


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in MODES:
        print(json.dumps(run(sys.argv[1])))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per run (3)")
    rounds = parser.parse_args().rounds
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for r in range(rounds):  # ABC, CBA, ABC, ...: no run always goes first on a busy machine
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            out = subprocess.run(
                [sys.executable, __file__, mode], capture_output=True, text=True, check=True
            )
            results[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = results["unprobed"][0]
    print(
        f"{base['params_m']:.1f}M float32 parameters ({base['gradient_mib']:.0f} MiB of gradient), "
        f"windows of {K} micro-batches of {ROWS}x{TOKENS} tokens, 1 thread, {rounds} rounds"
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

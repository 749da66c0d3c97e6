"""How long importing fullbatch's wings takes, against the bare frameworks they wrap.

    python benchmarks/import_time.py            # 7 runs per statement
    python benchmarks/import_time.py --runs 15
    python benchmarks/import_time.py --baseline-src /tmp/old/src   # + an older checkout's rows

Each statement runs in a fresh ``python -c`` process (the operating system's file cache stays
warm: a first, uncounted round fills it), the statements interleaved run by run so that a
change in the machine's load hits every one alike. For each: the median CPU time (user +
system of the child process: what the import costs, whatever else the machine is doing) with
its interquartile range, and the median wall time. Each fullbatch statement is paired with
the bare framework import it wraps; "fullbatch adds" is the median over runs of the CPU
difference between the two (run i of one against run i of the other).

With ``--baseline-src``, each fullbatch statement also runs against that ``src`` folder
(``PYTHONPATH``), interleaved with the others, so that a change is measured under one load.
On a loaded machine wall time is mostly waiting for a core; compare CPU times.

``python -X importtime`` is the tool to see where the time goes, but read it with care: it
does not log modules imported through ``importlib.import_module`` (TRL's and fullbatch's lazy
``__getattr__``), whose time then shows up as the self time of the module that asked.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

# (name, statement, the bare statement it is compared with)
ARMS = [
    ("bare trl, 3 trainers", "from trl import SFTTrainer, DPOTrainer, GRPOTrainer", None),
    (
        "fullbatch.trl, 3 trainers",
        "from fullbatch.trl import ExactSFTTrainer, ExactDPOTrainer, ExactGRPOTrainer",
        "bare trl, 3 trainers",
    ),
    ("bare trl SFTTrainer", "from trl import SFTTrainer", None),
    (
        "fullbatch.trl ExactSFTTrainer",
        "from fullbatch.trl import ExactSFTTrainer",
        "bare trl SFTTrainer",
    ),
    ("bare transformers Trainer", "from transformers import Trainer", None),
    (
        "fullbatch.hf ExactTrainer",
        "from fullbatch.hf import ExactTrainer",
        "bare transformers Trainer",
    ),
    ("bare torch", "import torch", None),
    ("fullbatch Accumulator", "from fullbatch import Accumulator", "bare torch"),
]


def _run(statement: str, src: str | None = None) -> tuple[float, float]:
    """(CPU seconds of the child, wall seconds) for one fresh interpreter."""
    env = None if src is None else {**os.environ, "PYTHONPATH": src}
    before = os.times()
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-W", "ignore", "-c", statement],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    wall = time.perf_counter() - start
    after = os.times()
    cpu = (after.children_user - before.children_user) + (
        after.children_system - before.children_system
    )
    return cpu, wall


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, _, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (values[0],) * 3
    return q1, statistics.median(values), q3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="fresh processes per statement")
    parser.add_argument(
        "--baseline-src",
        metavar="DIR",
        default=None,
        help="also run the fullbatch statements with PYTHONPATH=DIR (an older checkout's src)",
    )
    args = parser.parse_args()
    rows = [(name, statement, pair, None) for name, statement, pair in ARMS]
    if args.baseline_src:
        rows += [
            (f"{name} [baseline]", statement, pair, args.baseline_src)
            for name, statement, pair in ARMS
            if pair is not None
        ]
    for _, statement, _, src in rows:  # fill the file cache; not counted
        _run(statement, src)
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name, *_ in rows}
    for _ in range(args.runs):
        for name, statement, _, src in rows:
            samples[name].append(_run(statement, src))
    print(f"python {sys.version.split()[0]}, {len(os.sched_getaffinity(0))} CPUs, {args.runs} "
          f"fresh processes per row, load average {os.getloadavg()[0]:.1f} at the end")  # fmt: skip
    print("| arm | import | CPU s, median (IQR) | wall s, median | fullbatch adds, CPU s |")
    print("|---|---|---|---|---|")
    for name, statement, pair, _ in rows:
        cpu = [c for c, _ in samples[name]]
        q1, med, q3 = _quartiles(cpu)
        wall = statistics.median(w for _, w in samples[name])
        added = ""
        if pair is not None:
            bare = [c for c, _ in samples[pair]]
            added = f"{statistics.median(a - b for a, b in zip(cpu, bare, strict=True)):+.2f}"
        print(f"| {name} | `{statement}` | {med:.2f} ({q1:.2f}-{q3:.2f}) | {wall:.2f} | {added} |")


if __name__ == "__main__":
    main()

"""How long importing fullbatch's TRL and Trainer wings takes, against the bare frameworks.

    python benchmarks/import_time.py            # 7 runs per statement
    python benchmarks/import_time.py --runs 15
    python benchmarks/import_time.py --baseline-src /tmp/old/src   # + an older checkout's rows

Each statement runs in a fresh ``python -c`` process (the operating system's file cache stays
warm: the first run of the session is not counted), arms interleaved run by run so that a
change in the machine's load hits every arm alike. For each: the median CPU time (user +
system, of the child process: what the import costs, whatever else the machine is doing),
the median wall time, and, from one extra ``python -X importtime`` run, the time spent in
fullbatch's own modules (their self time) and in the three heaviest packages.

On a loaded machine wall time is mostly waiting for a core; compare CPU times. A
``fullbatch ...`` row minus its ``bare ...`` row is what fullbatch adds. ``-X importtime``
does not list modules imported through ``importlib.import_module`` (fullbatch's lazy
``__getattr__``), so the "own modules" column misses their self time; the CPU columns do not.
With ``--baseline-src``, each fullbatch statement also runs against that ``src`` folder
(``PYTHONPATH``), interleaved with the others, so that a change is measured under one load.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

ARMS = {
    "bare trl (3 trainers)": "from trl import SFTTrainer, DPOTrainer, GRPOTrainer",
    "fullbatch.trl (3 trainers)": (
        "from fullbatch.trl import ExactSFTTrainer, ExactDPOTrainer, ExactGRPOTrainer"
    ),
    "bare trl SFTTrainer": "from trl import SFTTrainer",
    "fullbatch.trl ExactSFTTrainer": "from fullbatch.trl import ExactSFTTrainer",
    "bare transformers Trainer": "from transformers import Trainer",
    "fullbatch.hf ExactTrainer": "from fullbatch.hf import ExactTrainer",
    "bare torch": "import torch",
    "fullbatch Accumulator": "from fullbatch import Accumulator",
}

LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \|(\s*)(\S+)")


def _env(src: str | None) -> dict[str, str] | None:
    return None if src is None else {**os.environ, "PYTHONPATH": src}


def _run(statement: str, src: str | None = None) -> tuple[float, float]:
    """(CPU seconds of the child, wall seconds) for one fresh interpreter."""
    before = os.times()
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-W", "ignore", "-c", statement],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=_env(src),
    )
    wall = time.perf_counter() - start
    after = os.times()
    cpu = (after.children_user - before.children_user) + (
        after.children_system - before.children_system
    )
    return cpu, wall


def _breakdown(statement: str, src: str | None) -> tuple[float, float, list[tuple[str, float]]]:
    """From ``-X importtime``: (total s, fullbatch's own modules' self time s, top packages)."""
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-X", "importtime", "-c", statement],
        check=True,
        capture_output=True,
        text=True,
        env=_env(src),
    )
    own, total, packages = 0, 0, {}
    for line in proc.stderr.splitlines():
        match = LINE.match(line)
        if match is None:
            continue
        self_us, cumulative_us, indent, name = match.groups()
        if name.split(".")[0] == "fullbatch":
            own += int(self_us)
        if len(indent) == 1:  # top-level imports of the statement itself
            total += int(cumulative_us)
        top = name.split(".")[0]
        packages[top] = packages.get(top, 0) + int(self_us)
    heaviest = sorted(packages.items(), key=lambda kv: -kv[1])[:3]
    return total / 1e6, own / 1e6, [(k, v / 1e6) for k, v in heaviest]


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
    rows = [(name, statement, None) for name, statement in ARMS.items()]
    if args.baseline_src:
        rows += [
            (f"{name} [baseline]", statement, args.baseline_src)
            for name, statement in ARMS.items()
            if name.startswith("fullbatch")
        ]
    for _, statement, src in rows:  # fill the file cache; not counted
        _run(statement, src)
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in rows}
    for _ in range(args.runs):
        for name, statement, src in rows:
            samples[name].append(_run(statement, src))
    print(f"python {sys.version.split()[0]}, {args.runs} fresh processes per row, load average "
          f"{os.getloadavg()[0]:.1f} at the end")  # fmt: skip
    print("| arm | import | CPU s (median) | wall s (median) | importtime total s | fullbatch's "
          "own modules s | heaviest packages (self time s) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, statement, src in rows:
        cpu = statistics.median(c for c, _ in samples[name])
        wall = statistics.median(w for _, w in samples[name])
        total, own, heaviest = _breakdown(statement, src)
        top = ", ".join(f"{k} {v:.2f}" for k, v in heaviest)
        print(f"| {name} | `{statement}` | {cpu:.2f} | {wall:.2f} | {total:.2f} | {own:.3f} "
              f"| {top} |")  # fmt: skip


if __name__ == "__main__":
    main()

"""Every number in the README, from one command: the demo and both benchmarks, run now.

    python benchmarks/readme_numbers.py            # measure and print the README's sections
    python benchmarks/readme_numbers.py --write    # ... and rewrite them, and docs/demo.png
    python benchmarks/readme_numbers.py --quick    # a short run that checks the pipeline
    python benchmarks/readme_numbers.py --write --demo-only   # the demo and picture only

It runs, each in its own process with this interpreter: ``fullbatch demo`` (100 steps; its
``loss.png`` becomes ``docs/demo.png`` with ``--write``), ``benchmarks/overhead.py`` (1-, 4- and
16-row micro-batches) and ``benchmarks/ddp_window_time.py`` under ``torchrun`` with 2 gloo
ranks (with ``--demo-only``, only the demo: the timings are kept from
``benchmarks/readme_numbers.json``). It prints what each prints, then the README's marked
sections as Markdown. With
``--write`` it replaces the text between ``<!-- readme_numbers: NAME -->`` and
``<!-- /readme_numbers -->`` in README.md and stores the measured values in
``benchmarks/readme_numbers.json`` (``tests/docs/test_readme_numbers.py`` checks that the README
says what that file holds).

The demo's numbers are deterministic on one machine: the same Python (its standard library is
the demo's corpus, named by a digest), torch and transformers give the same numbers bit for
bit, on any number of threads. Another CPU, or other kernels (AVX2, AVX-512: recorded as
``kernels``), moves their rounding-size digits (3.6e-7 to 4.8e-7 for fullbatch so far), so the
README's first screen quotes what holds on any CPU (the bound ``BOUND``, checked here: a run
above it writes nothing, and naive's gap) and gives the digits only as one machine's. Timings
vary from run to run; each comes with its spread.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "readme_numbers.json"
PICTURE = ROOT / "docs" / "demo.png"
SECTION = re.compile(
    r"(<!-- readme_numbers: (?P<name>[a-z_]+) -->\n)(?P<body>.*?)(<!-- /readme_numbers -->)",
    re.DOTALL,
)
BOUND = 1e-6  # fullbatch's worst demo error, on every CPU tried (3.6e-7 to 4.8e-7)
OVERHEAD_CMD = "python benchmarks/overhead.py"
DDP_CMD = "torchrun --standalone --nproc-per-node 2 benchmarks/ddp_window_time.py"


def _run(cmd: list[str], out: Path) -> str:
    """Run ``cmd`` (progress on stderr passes through); echo and return its stdout."""
    print(f"$ {' '.join(cmd)}", flush=True)
    # This checkout's sources first; every benchmark sets its own threads, and the demo's
    # numbers do not depend on them (one thread is fastest on a shared machine).
    path = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=out, env=env)
    print(proc.stdout, flush=True)
    if proc.returncode != 0:
        sys.exit(f"readme_numbers: {cmd[2]} exited with {proc.returncode}; nothing written")
    return proc.stdout


def run_demo(out: Path, quick: bool) -> dict[str, Any]:
    demo = out / "demo"
    steps = ["--steps", "20"] if quick else []
    printed = _run([sys.executable, "-m", "fullbatch", "demo", *steps, "--out", str(demo)], out)
    with (demo / "metrics.csv").open(encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    worst: dict[str, float] = {}
    for row in rows:
        arm = row["arm"]
        worst[arm] = max(worst.get(arm, 0.0), float(row["shadow_grad_error"]))
    corpus = re.search(r"Verdict \(Python (\S+), corpus ([0-9a-f]+)\)", printed)
    assert corpus is not None, "the demo no longer prints its corpus digest"
    # The kernels the demo ran with: the same interpreter and environment (ATEN_CPU_CAPABILITY).
    kernels = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
        stdout=subprocess.PIPE,
        text=True,
        check=True,
    ).stdout.strip()
    return {
        "steps": max(int(row["step"]) for row in rows),
        "python": corpus[1],
        "corpus": corpus[2],
        "kernels": kernels,
        "fullbatch": worst["fullbatch"],
        "permuted_rows": worst["permuted_rows"],
        "naive": worst["naive"],
        "picture": str(demo / "loss.png"),
    }


def run_overhead(out: Path, quick: bool) -> dict[str, Any]:
    reps = ["--reps", "8", "--warmup", "2"] if quick else []
    script = str(ROOT / "benchmarks" / "overhead.py")
    _run([sys.executable, script, *reps, "--json", str(out / "overhead.json")], out)
    return json.loads((out / "overhead.json").read_text(encoding="utf-8"))


def run_ddp(out: Path, quick: bool) -> dict[str, Any]:
    reps = ["--reps", "4"] if quick else []
    script = str(ROOT / "benchmarks" / "ddp_window_time.py")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd = [*launcher, "--nproc-per-node", "2", script, *reps, "--json", str(out / "ddp.json")]
    _run(cmd, out)
    return json.loads((out / "ddp.json").read_text(encoding="utf-8"))


def environment() -> dict[str, Any]:
    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "absent"

    return {
        "python": platform.python_version(),
        "torch": version("torch"),
        "transformers": version("transformers"),
        "cpus": os.cpu_count(),
    }


def sci(x: float) -> str:
    """``2.5e-7``, not ``2.5e-07``."""
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def power(x: float) -> str:
    """``1e-6``, not ``1e-06``."""
    mantissa, exponent = f"{x:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def fill(text: str) -> str:
    return textwrap.fill(text, 95, break_on_hyphens=False, break_long_words=False)


def render(results: dict[str, Any]) -> dict[str, str]:
    """The README's sections, by marker name, from the measured values."""
    env, demo, over, ddp = (results[k] for k in ("environment", "demo", "overhead", "ddp"))
    intro = fill(
        f"At every one of {demo['steps']} steps fullbatch's gradient is within {power(BOUND)} "
        "of the full batch's, as close as the full batch with its rows permuted (float32 "
        "rounding; its digits vary with the CPU: [one machine's run](#measured)); naive is "
        f"off by up to {demo['naive']:.0%}."
    )
    ratios = ", ".join(
        f"{r['ratio']:.3f} ({r['ci_low']:.2f}-{r['ci_high']:.2f}) at {r['micro_batch_size']}-row"
        for r in over["rows"]
    )
    lines = [
        fill(
            f"Measured by `python benchmarks/readme_numbers.py --write`, which runs the three "
            f"commands below and rewrote this section (Python {env['python']}, torch "
            f"{env['torch']}, transformers {env['transformers']}, {env['cpus']} CPU cores):"
        ),
        "",
        "| what | command | result |",
        "|---|---|---|",
        f"| exactness, tiny Llama, float32 | `fullbatch demo` | gradient within "
        f"{sci(demo['fullbatch'])} of the full batch at every one of {demo['steps']} steps "
        f"(rows permuted: {sci(demo['permuted_rows'])}; this run's digits, {demo['kernels']} "
        f"kernels; below {power(BOUND)} on every CPU tried); naive `loss / K` off by up to "
        f"{demo['naive']:.0%} |",
        f"| bookkeeping cost, one process | `{OVERHEAD_CMD}` | fullbatch / hand-written "
        f"`loss_sum / N` loop, s/window (95% interval): {ratios} micro-batches (table below) |",
        f"| gradient sync, {ddp['world']} gloo ranks | `{DDP_CMD}` | {ddp['fullbatch']:.3f} "
        f"s/window vs {ddp['sync_every']:.3f} s for a loop that syncs every micro-batch "
        f"({ddp['sync_every'] / ddp['fullbatch']:.2f}x, K={ddp['micro_batches']}, "
        f"{ddp['params'] / 1e6:.1f}M parameters) |",
        "",
        fill(f"Bookkeeping cost by micro-batch size ({over['setup']}; {over['note']}):"),
        "",
        over["header"],
        *over["table"],
    ]
    lines += [
        "",
        fill(
            "The demo's numbers are deterministic on one machine for a given Python, torch "
            "and transformers, whatever the number of threads; another CPU or kernel set "
            f"(here {demo['kernels']}) moves their rounding-size digits (see below). Its "
            "corpus is the standard library's docstrings "
            f"(here Python {demo['python']}, corpus digest `{demo['corpus']}`, printed by the "
            "demo), so another Python version trains on other text and gives other, equally "
            "small, numbers. Timings vary from run to run: a ratio is known only to within "
            "its 95% interval."
        ),
    ]
    return {"demo": intro, "measured": "\n".join(lines)}


def rewrite(text: str, sections: dict[str, str]) -> str:
    """``text`` with every marked section replaced; every section must be marked once."""
    found = [m["name"] for m in SECTION.finditer(text)]
    if sorted(found) != sorted(sections):
        raise ValueError(f"README markers {found} do not match the sections {sorted(sections)}")
    return SECTION.sub(lambda m: f"{m[1]}{sections[m['name']]}\n{m[4]}", text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite README.md and docs/demo.png")
    parser.add_argument(
        "--quick", action="store_true", help="few steps and reps (~2 min); writes nothing"
    )
    parser.add_argument(
        "--demo-only",
        action="store_true",
        help="run only the demo; keep the stored overhead and DDP timings (and their "
        "environment) from benchmarks/readme_numbers.json",
    )
    args = parser.parse_args()
    if args.quick and args.write:
        parser.error("--quick numbers are for checking the pipeline; --write needs a full run")
    with tempfile.TemporaryDirectory(prefix="readme_numbers-") as tmp:
        out = Path(tmp)
        if args.demo_only:
            results = json.loads(RESULTS.read_text(encoding="utf-8"))
            if results["environment"] != environment():
                sys.exit(
                    "readme_numbers: the stored timings were measured with "
                    f"{results['environment']}, not {environment()}; run without --demo-only"
                )
            results["demo"] = run_demo(out, args.quick)
        else:
            results = {
                "environment": environment(),
                "demo": run_demo(out, args.quick),
                "overhead": run_overhead(out, args.quick),
                "ddp": run_ddp(out, args.quick),
            }
        picture = results["demo"].pop("picture")
        if not results["demo"]["fullbatch"] < BOUND:
            sys.exit(
                f"readme_numbers: fullbatch's demo error {results['demo']['fullbatch']:.3g} is "
                f"not below the README's bound {BOUND:.0e}; nothing written"
            )
        sections = render(results)
        for name, body in sections.items():
            print(f"<!-- readme_numbers: {name} -->\n{body}\n<!-- /readme_numbers -->\n")
        if args.write:
            shutil.copyfile(picture, PICTURE)
            RESULTS.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
            text = rewrite(README.read_text(encoding="utf-8"), sections)
            README.write_text(text, encoding="utf-8")
            print(f"Wrote {README.name}, {PICTURE.relative_to(ROOT)} and {RESULTS.name}.")


if __name__ == "__main__":
    main()

"""Issue 40's table ("the probe, round 3: judge the whole step the user asked for"),
re-measured: each row a script written as users write them (``benchmarks/probe_round3/``),
each with its float64 truth inside it, probed the way a user probes it.

    PYTHONPATH=src python benchmarks/probe_round3.py    # about 3-6 minutes on 2 busy cores

For each row:

- **the truth**: the script run plainly (``python SCRIPT ARGS``); at its end it prints
  ``TRUTH {"error": ...}``: its first window's update against the float64 full-batch update
  it asked for (the loss over the window's rows as one batch, clipped as it asked), relative;
  *right* is within 1e-5 (float32 rounding);
- **the probe**: ``python -m fullbatch probe [options] -- COMMAND`` in a subprocess: the
  verdict it prints, the patterns it names, its exit status, and what else the row is about
  (a note: the script reached its end, the parameters' hash against the unprobed run's, the
  seconds until a refusal, a line of its text).

The rows of another engineer's half of the issue (--keep-training with a raising objective,
inductor bitwise, exit codes after a crash, commands that are not Python, an objective that
cannot be inferred) show the behaviour of the code this runs on.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent / "probe_round3"
ROOT = Path(__file__).resolve().parent.parent
RIGHT_WITHIN = 1e-5
KNOWN = (
    "scaled clip", "clip differs", "coupled loss", "dropped", "mean of per-micro-batch means",
    "not normalized", "right", "loss differs", "other", "nothing to check",
    "coupled loss taken per micro-batch",
    "a window statistic taken per micro-batch",
)  # fmt: skip


@dataclass
class Row:
    name: str
    command: list[str]  # after ``--``
    probe: list[str] = field(default_factory=list)
    truth: bool = True  # the script prints its TRUTH line
    note: Callable[[str, str], str] | None = None  # (probe output, plain output) -> text


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1",
            "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "default::DeprecationWarning"}  # fmt: skip


def _run(cmd: list[str]) -> tuple[int, str, float]:
    start = time.perf_counter()
    try:
        out = subprocess.run(cmd, cwd=HERE, capture_output=True, text=True, env=_env(),
                             timeout=600)  # fmt: skip
    except subprocess.TimeoutExpired:
        return -1, "(timed out after 600 s)", time.perf_counter() - start
    return out.returncode, out.stdout + out.stderr, time.perf_counter() - start


def _python(command: list[str]) -> list[str]:
    return [sys.executable, *command[1:]] if command[0] == "python" else command


def truth(row: Row) -> tuple[str, str]:
    """The row's truth (a plain run) and that run's output."""
    if not row.truth:
        return "—", ""
    _, out, _ = _run(_python(row.command))
    found = re.search(r"^TRUTH (.*)$", out, re.M)
    if found is None:
        last = out.strip().splitlines()[-1][:60] if out.strip() else "no output"
        return f"(no truth: {last})", out
    error = json.loads(found.group(1))["error"]
    if error is None:
        return "—", out
    return f"{'right' if error <= RIGHT_WITHIN else 'wrong'} ({error:.2g})", out


def probe(row: Row) -> tuple[str, int, str, float]:
    """The probe's verdict and patterns, its exit status, its output and its seconds."""
    cmd = [sys.executable, "-m", "fullbatch", "probe", *row.probe, "--", *row.command]
    status, out, seconds = _run(cmd)
    head = next((line for line in out.splitlines() if line.startswith("fullbatch probe: ")), "")
    verdict = head.removeprefix("fullbatch probe: ").split(" (")[0] if head else "(no report)"
    if head.startswith("fullbatch probe: error:") or head.startswith("fullbatch probe: note:"):
        verdict = "error: " + head.split(": ", 2)[2][:90]
    patterns = re.findall(r"^  ([a-z][a-z -]+?)(?::|,)", out, re.M)
    if ", and a mean of per-micro-batch means" in out:
        patterns.append("mean of per-micro-batch means")
    if "; and a window statistic taken per micro-batch" in out:  # named after another
        patterns.append("a window statistic taken per micro-batch")
    named = [p for p in dict.fromkeys(patterns) if p in KNOWN]
    if named and not verdict.startswith("error"):
        verdict = f"{verdict}: {' + '.join(named)}"
    return verdict, status, out, seconds


def _end(out: str, _: str) -> str:
    return "the script reached its end" if "END" in out else "**the script was cut short**"


def _line(text: str) -> Callable[[str, str], str]:
    def note(out: str, _: str) -> str:
        line = next((x.strip() for x in out.splitlines() if text in x), "")
        return line[:110] if line else f"(no line with {text!r})"

    return note


def _bitwise(out: str, plain: str) -> str:
    a, b = re.search(r"PARAMS (\w+)", out), re.search(r"PARAMS (\w+)", plain)
    if a is None or b is None:
        return "(no parameters printed)"
    return (
        "bitwise equal to the unprobed run"
        if a.group(1) == b.group(1)
        else ("**differs from the unprobed run**")
    )


ROWS = [
    Row("fp16 GradScaler, clip_grad_norm_ before scaler.unscale_", ["python", "amp_clip.py"],
        ["--objective", "sample"], note=_line("clip's input norm")),
    Row("same, unscale_ first (the AMP recipe)", ["python", "amp_clip.py", "--unscale-first"],
        ["--objective", "sample"]),
    Row("stock TRL DPOTrainer (sigmoid), no --objective", ["python", "trl_dpo.py"],
        note=_line("micro-batches")),
    Row("same, 3 pairs in micro-batches of 2 and 1", ["python", "trl_dpo.py", "--uneven"],
        note=_line("weights:")),
    Row("3-output F.mse_loss regression (element mean), --objective sample",
        ["python", "mse_regression.py"], ["--objective", "sample"], note=_line("counted in")),
    Row("InfoNCE, encoder on q and k, pair kept in one variable",
        ["python", "contrastive.py"], ["--objective", "contrastive.py:info_nce"],
        note=_line("cannot judge")),
    Row("InfoNCE, `for step, (q, k) in enumerate(...)` (pair unpacked)",
        ["python", "contrastive.py", "--unpacked"], ["--objective", "contrastive.py:info_nce"],
        note=_line("micro-batches, ")),
    Row("InfoNCE, pair unpacked, declared --coupled", ["python", "contrastive.py", "--unpacked"],
        ["--objective", "contrastive.py:info_nce", "--coupled"], note=_line("weighted 1.00")),
    Row("InfoNCE through window.run_coupled (GradCache), declared --coupled",
        ["python", "contrastive.py", "--gradcache"],
        ["--objective", "contrastive.py:info_nce", "--coupled"], note=_line("micro-batches, ")),
    Row("per-micro-batch means, 2 of 4 micro-batches dropped (0.17.0's weights)",
        ["python", "dropped_means.py"], ["--objective", "sample"], note=_line("weights:")),
    Row("a micro-batch with 0 counted items", ["python", "no_items.py"],
        ["--objective", "sample"], note=_line("no items")),
    Row("--objective masked_lm (last release's name)", ["python", "token_loop.py"],
        ["--objective", "masked_lm"], note=_line("deprecated")),
    Row("--keep-training, an objective that raises", ["python", "keep_training.py"],
        ["--keep-training", "--objective", "broken_objective.py:broken"], truth=False,
        note=_end),
    Row("torch.compile (inductor), --keep-training", ["python", "inductor.py"],
        ["--keep-training", "--objective", "sample"], truth=False, note=_bitwise),
    Row("the script crashes in window 2 after a right window 1", ["python", "crash_later.py"],
        ["--objective", "sample"], truth=False),
    Row("the script calls sys.exit(3) in window 2", ["python", "crash_later.py", "--exit3"],
        ["--objective", "sample"], truth=False),
    Row("`-- ./run.sh`", ["./run.sh"], truth=False),
    Row("`-- bash run.sh`", ["bash", "run.sh"], truth=False),
    Row("`-- ls`", ["ls"], truth=False),
    Row("HF Trainer + DeepSpeed ZeRO-2 without gradient_clipping, max_grad_norm=0.3",
        ["python", "hf_deepspeed_clip.py"], note=_line("clip: asked")),
    Row("objective not inferable (a plain module, no --objective)",
        ["python", "not_inferable.py"], truth=False),
    Row("MoE (tiny Mixtral, aux on): stock loop model(**micro).loss / K",
        ["python", "moe_stock.py"], note=_line("per micro-batch:")),
    Row("MoE: stock HF Trainer (num_items_in_batch)", ["python", "moe_stock.py", "--trainer"],
        note=_line("per micro-batch:")),
    Row("MoE: fullbatch.hf.ExactTrainer(loss='causal_lm')", ["python", "moe_stock.py", "--exact"],
        note=_line("per micro-batch:")),
]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--only", action="append", default=[], help="the rows whose name contains this text "
        "(repeat for several)",
    )  # fmt: skip
    opts = parser.parse_args()
    start = time.perf_counter()
    print("| row | truth (float64) | probe: verdict, patterns | exit | s | note |")
    print("|---|---|---|---|---|---|")
    rows = [r for r in ROWS if not opts.only or any(text in r.name for text in opts.only)]
    for row in rows:
        said, status, out, seconds = probe(row)
        right, plain = truth(row)
        if row.note is _bitwise:
            _, plain, _ = _run(_python(row.command))
        note = row.note(out, plain) if row.note is not None else ""
        print(f"| {row.name} | {right} | {said} | {status} | {seconds:.1f} | {note} |",
              flush=True)  # fmt: skip
    print(f"\n{len(rows)} rows in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()

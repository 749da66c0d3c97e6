"""``scripts/gpu_check.py`` keeps working while no GPU is lent: its CPU smoke rows run the same
code paths (gloo for NCCL, CPU autocast, a simulated out-of-memory error, packing on sdpa) and
pass; without CUDA and without ``--cpu`` it says so and exits 2, without a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"
ROWS = {"nccl", "bf16", "fp16", "oom", "syncs", "pack", "speed", "graphs", "shapes", "torchtitan"}

pytestmark = pytest.mark.timeout(300)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=280
    )


def _tables(stdout: str) -> list[list[list[str]]]:
    """The markdown tables printed (header row first, separator left out), in order."""
    tables: list[list[list[str]]] = []
    current: list[list[str]] = []
    for line in [*stdout.splitlines(), ""]:
        if line.startswith("|"):
            if not line.startswith("|---"):
                current.append([cell.strip() for cell in line.split("|")[1:-1]])
        elif current:
            tables.append(current)
            current = []
    return tables


def test_cpu_smoke_rows_pass() -> None:
    done = _run("--cpu")
    assert done.returncode == 0, done.stdout + done.stderr
    checks, shapes = _tables(done.stdout)[:2]
    status = {row[0]: row[1] for row in checks[1:]}
    assert set(status) == ROWS, done.stdout
    assert status.pop("syncs") == status.pop("graphs") == status.pop("torchtitan") == "skip"
    assert status.pop("speed") == "info"  # timed on a shared CPU: printed, never judged
    assert set(status.values()) == {"pass"}, done.stdout
    # the shape-churn table: every arm, new and seen seconds, its distinct shapes
    arms = {row[0]: row for row in shapes[1:]}
    assert len(arms) == 9 and "sort_rows=True, pad_to_multiple_of=64" in arms, done.stdout
    assert all(  # seconds to 3 significant digits: a run too fast to time still prints > 0
        float(row[1]) > 0 and float(row[2]) > 0 and int(row[4]) >= 1 for row in arms.values()
    ), done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_says_so_and_exits_2() -> None:
    done = _run()
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no CUDA device" in done.stdout and "--cpu" in done.stdout
    assert "Traceback" not in done.stderr


def test_an_unknown_row_is_refused() -> None:
    done = _run("--cpu", "--rows", "nccl,warp")
    assert done.returncode == 2 and "unknown rows ['warp']" in done.stderr

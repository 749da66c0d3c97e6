"""The distributed example runs under torchrun with 2 CPU ranks, as the README shows."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("extra", [[], ["--fsdp"]], ids=["ddp", "fsdp2"])
def test_train_ddp_example_under_torchrun(extra: list[str]) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(ROOT / "examples" / "train_ddp.py"),
        "--steps",
        "3",
        *extra,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    losses = [float(x) for x in re.findall(r"step \d+: loss ([0-9.]+)", proc.stdout)]
    assert len(losses) == 3, proc.stdout
    assert losses[-1] < losses[0]  # it trains

"""``fullbatch probe -- python train.py ARGS``: real subprocesses on tiny scripts, their exit
codes (0 right, 1 wrong or nothing checked, 2 usage error with one line and no traceback), the
script's own ``sys.argv`` and ``__main__``, and stopping after the probed windows."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_SRC = str(Path(__file__).parents[2] / "src")

SCRIPT = """
import sys
import torch
import torch.nn.functional as F

assert __name__ == "__main__", __name__
assert sys.argv[0].endswith("train.py"), sys.argv
mode = sys.argv[1]  # the script's own arguments, as python would give them
torch.manual_seed(0)
model = torch.nn.Linear(4, 3)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = [{"x": torch.randn(n, 4), "labels": torch.randint(3, (n,))} for n in (1, 3, 2, 5)] * 2
for i, batch in enumerate(data):
    logits = model(batch["x"])
    if mode == "right":
        loss = F.cross_entropy(logits, batch["labels"], reduction="sum") / 11
    else:  # each micro-batch's mean over 4
        loss = F.cross_entropy(logits, batch["labels"]) / 4
    loss.backward()
    if (i + 1) % 4 == 0 and mode != "never-steps":
        opt.step()
        opt.zero_grad()
    if mode == "raises" and i == 1:
        raise KeyError("the script's own bug")
print("script finished")
"""

OBJECTIVE = """
import fullbatch as fb

def loss(model, batch):
    return fb.cross_entropy_sum(model(batch["x"]), batch["labels"])
"""


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text(textwrap.dedent(SCRIPT))
    (tmp_path / "obj.py").write_text(textwrap.dedent(OBJECTIVE))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "train.py").write_text(textwrap.dedent(SCRIPT))
    return tmp_path


def _probe(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": _SRC}
    return subprocess.run(
        [sys.executable, "-m", "fullbatch", "probe", *args],
        capture_output=True, text=True, cwd=folder, env=env, timeout=240,
    )  # fmt: skip


def test_right_script_exits_0_and_is_stopped_after_the_window(folder: Path) -> None:
    result = _probe(folder, "--objective", "obj.py:loss", "--", "python", "train.py", "right")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("fullbatch probe: RIGHT (1 window checked")
    assert "script finished" not in result.stdout  # stopped once the window was checked


def test_wrong_script_exits_1_with_the_diagnosis_and_keeps_training(folder: Path) -> None:
    result = _probe(
        folder, "--objective", "obj.py:loss", "--windows", "2", "--keep-training",
        "--", "python", "train.py", "wrong",
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert "WRONG (2 of 2 windows wrong" in result.stdout
    assert "mean of per-micro-batch means" in result.stdout
    assert "script finished" in result.stdout  # --keep-training ran it to its end


def test_python_dash_m_runs_a_module(folder: Path) -> None:
    result = _probe(
        folder, "--objective", "obj.py:loss", "--", "python", "-m", "pkg.train", "right"
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_script_that_never_steps_exits_1(folder: Path) -> None:
    result = _probe(folder, "--objective", "obj.py:loss", "--", "python", "train.py", "never-steps")
    assert result.returncode == 1
    assert "NOTHING CHECKED" in result.stdout and "no optimizer step was seen" in result.stdout


def test_script_that_raises_shows_its_traceback_and_exits_1(folder: Path) -> None:
    result = _probe(folder, "--objective", "obj.py:loss", "--", "python", "train.py", "raises")
    assert result.returncode == 1
    assert 'KeyError: "the script\'s own bug"' in result.stderr
    assert "NOTHING CHECKED" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--", "python", "missing.py"], "no such script: missing.py"),
        (["--windows", "0", "--", "python", "train.py"], "expected a positive integer"),
        (["--objective", "obj.py:nope", "--", "python", "train.py"], "has no attribute 'nope'"),
        (["--objective", "mean", "--", "python", "train.py"], "expected one of causal_lm"),
        ([], "no training command"),
        (["--", "python", "train.py", "right"], "the objective of Linear cannot be inferred"),
        (["--", "python", "-m", "nopkg.train"], "no such module: nopkg.train"),
    ],
)
def test_usage_errors_exit_2_with_one_line(folder: Path, args: list[str], message: str) -> None:
    result = _probe(folder, *args)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(lines) == 1 or lines[0].startswith("usage:"), result.stderr

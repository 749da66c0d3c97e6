"""``fullbatch probe -- python train.py ARGS``: real subprocesses on tiny scripts, their exit
codes (0 right, 1 wrong, 2 usage error with one line and no traceback, 3 nothing checked, 4
the script failed after right windows: never its own status), the script's own ``sys.argv`` and
``__main__``, the windows checked (2 by default, ``--windows all``), and stopping after them."""

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
data = [{"x": torch.randn(n, 4), "labels": torch.randint(3, (n,))} for n in (1, 3, 2, 5)] * 3
for i, batch in enumerate(data):  # 3 windows of 4 micro-batches, 11 rows each
    logits = model(batch["x"])
    if mode == "wrong":  # each micro-batch's mean over 4
        loss = F.cross_entropy(logits, batch["labels"]) / 4
    else:
        loss = F.cross_entropy(logits, batch["labels"], reduction="sum") / 11
    loss.backward()
    if (i + 1) % 4 == 0 and mode != "never-steps":
        opt.step()
        if mode != "no-zero-grad":
            opt.zero_grad()
    if mode == "raises" and i == 1:
        raise KeyError("the script's own bug")
    if mode == "raises-late" and i == 9:
        raise KeyError("a late bug")
    if mode == "exits-late" and i == 9:
        sys.exit(5)
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


def test_right_script_exits_0_and_is_stopped_after_the_default_two_windows(folder: Path) -> None:
    result = _probe(folder, "--objective", "obj.py:loss", "--", "python", "train.py", "right")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("fullbatch probe: RIGHT (windows 1-2 checked")
    assert "script finished" not in result.stdout  # stopped once the windows were checked


def test_windows_all_checks_every_window_to_the_script_end(folder: Path) -> None:
    result = _probe(
        folder, "--objective", "obj.py:loss", "--windows", "all", "--", "python", "train.py",
        "right",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "fullbatch probe: RIGHT (windows 1-3 checked" in result.stdout
    assert result.stdout.startswith("script finished")  # every window: the script ran to its end


def test_missing_zero_grad_exits_1_at_the_default_windows(folder: Path) -> None:
    result = _probe(
        folder, "--objective", "obj.py:loss", "--", "python", "train.py", "no-zero-grad"
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "window 2 wrong of windows 1-2 checked" in result.stdout
    assert "leftover gradient" in result.stdout


def test_wrong_script_exits_1_with_the_diagnosis_and_keeps_training(folder: Path) -> None:
    result = _probe(
        folder, "--objective", "obj.py:loss", "--windows", "2", "--keep-training",
        "--", "python", "train.py", "wrong",
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert "WRONG (windows 1-2 wrong of windows 1-2 checked" in result.stdout
    assert "mean of per-micro-batch means" in result.stdout
    assert "script finished" in result.stdout  # --keep-training ran it to its end


def test_python_dash_m_runs_a_module(folder: Path) -> None:
    result = _probe(
        folder, "--objective", "obj.py:loss", "--", "python", "-m", "pkg.train", "right"
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_script_that_never_steps_exits_3(folder: Path) -> None:
    result = _probe(folder, "--objective", "obj.py:loss", "--", "python", "train.py", "never-steps")
    assert result.returncode == 3, result.stdout + result.stderr
    assert "NOTHING CHECKED" in result.stdout and "no optimizer step was seen" in result.stdout


def test_script_that_raises_before_a_window_shows_its_traceback_and_exits_3(folder: Path) -> None:
    result = _probe(folder, "--objective", "obj.py:loss", "--", "python", "train.py", "raises")
    assert result.returncode == 3, result.stdout + result.stderr
    assert 'KeyError: "the script\'s own bug"' in result.stderr
    assert "NOTHING CHECKED" in result.stdout


@pytest.mark.parametrize(
    ("mode", "status", "shown"),
    [("raises-late", 1, "KeyError: 'a late bug'"), ("exits-late", 5, "")],
)
def test_keep_training_exits_4_on_the_scripts_later_failure(
    folder: Path, mode: str, status: int, shown: str
) -> None:
    """Right windows, then the script fails: not 0, and not the script's own status (a 1 would
    read as WRONG, a 3 as nothing checked) but 4; its own status is in the note."""
    result = _probe(
        folder, "--objective", "obj.py:loss", "--windows", "1", "--keep-training",
        "--", "python", "train.py", mode,
    )  # fmt: skip
    assert result.returncode == 4, result.stdout + result.stderr
    assert result.stdout.startswith("fullbatch probe: FAILED after right windows (window 1 checked")
    assert shown in result.stderr and "script finished" not in result.stdout
    assert f"the script failed (exit status {status}); fullbatch probe exits 4" in result.stdout


def test_the_same_failure_without_keep_training_is_never_reached(folder: Path) -> None:
    result = _probe(
        folder, "--objective", "obj.py:loss", "--windows", "1", "--", "python", "train.py",
        "raises-late",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "a late bug" not in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--", "python", "missing.py"], "no such script: missing.py"),
        (["--windows", "0", "--", "python", "train.py"], "expected a positive integer"),
        (["--windows", "every", "--", "python", "train.py"], "a positive integer or all"),
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


def test_help_names_the_windows_and_every_exit_status() -> None:
    text = subprocess.run(
        [sys.executable, "-m", "fullbatch", "probe", "--help"], capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": _SRC, "COLUMNS": "400"}, timeout=120, check=True,
    ).stdout  # fmt: skip
    assert "--windows N|all" in text and "the first 2" in text and "all: every window" in text
    for line in ("0  every probed window is right", "1  a probed window is wrong", "2  usage",
                 "3  nothing checked", "4  the script failed", "never the script's own",
                 "rank 0"):  # fmt: skip
        assert line in text, line


PROCESS_GROUP_SCRIPT = """
import os
import torch
import torch.distributed as dist
import torch.nn.functional as F

store = dist.FileStore(os.path.join(os.getcwd(), "store"), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
model = torch.nn.Linear(4, 3)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
torch.manual_seed(0)
for n in (1, 3, 2, 5) * 2:  # 2 windows of 4 micro-batches, 11 rows each
    x, y = torch.randn(n, 4), torch.randint(3, (n,))
    F.cross_entropy(model(x), y, reduction="sum").div(11).backward()
    if n == 5:
        opt.step()
        opt.zero_grad()
"""  # a script that leaves its process group up, as many do

LAUNCHER = """
import sys
import torch.distributed as dist
from fullbatch.cli import main

code = main(sys.argv[1:])
print("process group left up:", dist.is_initialized())
sys.exit(code)
"""


def test_the_process_group_a_finished_script_left_up_is_destroyed(folder: Path) -> None:
    """Gloo's threads can abort an exit with the group alive (torchrun then reports the abort,
    not the probe's status): the probe destroys it once the script has finished."""
    (folder / "pg.py").write_text(textwrap.dedent(PROCESS_GROUP_SCRIPT))
    (folder / "launch.py").write_text(textwrap.dedent(LAUNCHER))
    env = {**os.environ, "PYTHONPATH": _SRC}
    command = [
        sys.executable, "launch.py", "probe", "--objective", "sample", "--windows", "all",
        "--", "python", "pg.py",
    ]  # fmt: skip
    result = subprocess.run(
        command, capture_output=True, text=True, cwd=folder, env=env, timeout=240
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "fullbatch probe: RIGHT (windows 1-2 checked" in result.stdout, output
    assert "process group left up: False" in result.stdout, output

"""``fullbatch probe -- COMMAND``: only a Python command is run; anything else (a shell script,
``bash run.sh``, ``ls``, a launcher, ``uv run python ...``) is a usage error, exit 2, that says
"not a Python command" and gives the command that works, before anything runs. ``python``,
``python3``, ``python -m module``, a ``.py`` path alone and a script whose ``#!`` names python
keep working."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fullbatch._probe._command import CommandError, target

_SRC = str(Path(__file__).parents[2] / "src")


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "train.py").write_text("print('trained')\n")
    (tmp_path / "run.sh").write_text("#!/bin/bash\ntouch ran\npython train.py\n")
    (tmp_path / "run.sh").chmod(0o755)
    (tmp_path / "plain.sh").write_text("touch ran\n")  # no #! line: still a shell script
    (tmp_path / "trainer").write_text("#!/usr/bin/env python3\nprint('trained')\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "train.py").write_text("print('trained')\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize(
    ("command", "fix"),
    [
        (["./run.sh"], "fullbatch probe -- python train.py"),
        (["bash", "run.sh"], "in run.sh: put 'fullbatch probe --' before"),
        (["sh", "plain.sh"], "fullbatch probe -- python train.py"),
        (["ls", "-l"], "fullbatch probe -- python train.py"),
        (["python", "run.sh"], "run.sh is not a Python script (a shell script"),
        (["python3", "plain.sh"], "plain.sh is not a Python script"),
        (
            ["torchrun", "--nproc-per-node", "2", "train.py", "--lr", "1"],
            "torchrun --nproc-per-node 2 -m fullbatch probe [OPTIONS] -- python train.py --lr 1",
        ),
        (["uv", "run", "python", "train.py"], "uv run fullbatch probe -- python train.py"),
    ],
)
def test_not_a_python_command_is_refused_with_the_fix(
    folder: Path, command: list[str], fix: str
) -> None:
    with pytest.raises(CommandError) as raised:
        target(["--", *command])
    message = str(raised.value)
    assert "not a Python" in message and fix in message, message


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (["python", "train.py", "--lr", "1"], ("path", "train.py", ["--lr", "1"])),
        (["python3", "train.py"], ("path", "train.py", [])),
        (["python3.12", "train.py"], ("path", "train.py", [])),
        ([sys.executable, "train.py"], ("path", "train.py", [])),
        (["train.py", "x"], ("path", "train.py", ["x"])),
        (["./trainer"], ("path", "./trainer", [])),
        (["python", "-m", "pkg.train", "a"], ("module", "pkg.train", ["a"])),
    ],
)
def test_python_commands_keep_working(
    folder: Path, command: list[str], expected: tuple[str, str, list[str]]
) -> None:
    assert target(["--", *command]) == expected


def test_the_cli_exits_2_on_a_shell_script_and_runs_nothing(folder: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "fullbatch", "probe", "--", "./run.sh"],
        capture_output=True, text=True, cwd=folder, timeout=120,
        env={**os.environ, "PYTHONPATH": _SRC},
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "not a Python command" in lines[0], result.stderr
    assert "Traceback" not in result.stderr and not (folder / "ran").exists()

"""``fullbatch probe``'s exit status cannot be misread by a CI gate: 0 right, 1 wrong, 2 usage,
3 nothing checked, 4 the script failed after right windows; never the script's own status (a
script's ``sys.exit(3)`` would read as "nothing checked", an exception's 1 as WRONG). The
script's own status is in the note and in ``--json``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _cli_scripts import SRC, probe, write_scripts

from fullbatch._probe._cli_args import FAILED, STATUSES
from fullbatch._probe._export import problems


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return write_scripts(tmp_path)


def test_a_crash_in_window_2_after_a_right_window_1_exits_4_not_1(folder: Path) -> None:
    result = probe(folder, "--objective", "obj.py:loss", "--", "python", "train.py",
                   "raises-in-window-2")  # fmt: skip
    assert result.returncode == FAILED == 4, result.stdout + result.stderr
    assert "\nfullbatch probe: FAILED after right windows (window 1 checked" in result.stdout
    assert "window 1: right" in result.stdout
    assert "failed: the script raised KeyError: 'a bug in window 2'" in result.stdout
    assert "KeyError: 'a bug in window 2'" in result.stderr  # its traceback, as python shows it


@pytest.mark.parametrize("own", [1, 2, 3])
def test_the_scripts_own_exit_status_after_right_windows_is_4_and_in_the_json(
    folder: Path, own: int
) -> None:
    result = probe(
        folder, "--objective", "obj.py:loss", "--windows", "1", "--keep-training",
        "--json", "probe.json", "--", "python", "train.py", f"exits-{own}",
    )  # fmt: skip
    assert result.returncode == 4, result.stdout + result.stderr
    assert f"the script exited with status {own}" in result.stdout
    data = json.loads((folder / "probe.json").read_text())
    assert (data["exit_status"], data["script_status"], data["verdict"]) == (4, own, "failed")
    assert [w["ok"] for w in data["windows"]] == [True] and problems(data) == []


def test_help_lists_every_exit_status_and_says_none_is_the_scripts() -> None:
    text = subprocess.run(
        [sys.executable, "-m", "fullbatch", "probe", "--help"], capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": SRC, "COLUMNS": "400"}, timeout=120, check=True,
    ).stdout  # fmt: skip
    assert "exit status (never the script's own):" in text
    flat = " ".join(text.split())
    for code, meaning in STATUSES.items():
        assert f"{code} {' '.join(meaning.split())}" in flat, code
    assert sorted(STATUSES) == [0, 1, 2, 3, 4]

"""``fullbatch --help``, ``fullbatch verify --help`` and ``fullbatch probe --help`` import no torch
(issue 8, item 8)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_SRC = str(Path(__file__).parents[2] / "src")

_PROBE = """
import sys
from fullbatch.cli import main

for argv in (["--help"], ["verify", "--help"], ["demo", "--help"], ["probe", "--help"],
             ["--version"]):
    try:
        main(argv)
    except SystemExit:
        pass
print("TORCH:", sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""


def _python(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": _SRC}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_help_imports_no_torch() -> None:
    result = _python("-c", _PROBE)
    assert result.returncode == 0, result.stderr
    assert "usage: fullbatch verify" in result.stdout
    assert "usage: fullbatch probe" in result.stdout
    assert result.stdout.strip().splitlines()[-1] == "TORCH: []"


@pytest.mark.parametrize("argv", [["--help"], ["verify", "--help"], ["probe", "--help"]])
def test_importtime_of_help_shows_no_torch(argv: list[str]) -> None:
    result = _python("-X", "importtime", "-m", "fullbatch", *argv)
    assert result.returncode == 0, result.stderr
    imported = [line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()]
    assert not [m for m in imported if m == "torch" or m.startswith("torch.")]
    assert "fullbatch.cli" in imported


def test_public_names_still_resolve_lazily() -> None:
    probe = (
        "import sys, fullbatch as fb; assert 'torch' not in sys.modules; "
        "print(fb.verify.__module__, fb.Accumulator.__name__, fb.testing.__name__, "
        "'torch' in sys.modules)"
    )
    result = _python("-c", probe)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [
        "fullbatch._verify._run",
        "Accumulator",
        "fullbatch.testing",
        "True",
    ]

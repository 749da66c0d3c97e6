"""docs/probe.md's picture: ``fullbatch probe --plot`` (and ``--json``) through the command that
regenerates docs/probe_plot.png (``benchmarks/probe_plot.py``), into a temporary folder: a PNG
of a sensible size, from a run the probe judged wrong, as the picture in the docs shows."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", "not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_the_probe_draws_its_report(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "probe_plot.png"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "probe_plot.py"), str(out)],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "json verdict 'wrong'" in result.stdout
    width, height = _png_size(out)
    assert 500 <= width <= 3000 and 400 <= height <= 2000, (width, height)
    assert out.stat().st_size > 20_000  # drawn, not an empty canvas
    assert _png_size(ROOT / "docs" / "probe_plot.png") == (width, height)  # the docs' one: same

"""docs/moe.md's cost table comes from ``benchmarks/moe_window_stats.py``: its peak-memory
reader (``benchmarks/_alloc_peak.py``, torch.profiler's allocation events) sees a known live
set, and one exact row and one cost row of the benchmark run here on a tiny Mixtral (one
process, one timed window: seconds), the row against the benchmark's float64 full batch."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str) -> Any:
    """A benchmark module; sys.path as it was afterwards (benchmarks/ holds generic names)."""
    saved = list(sys.path)
    try:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
    return module


def test_peak_bytes_is_the_largest_live_set() -> None:
    peak_bytes = _load("_alloc_peak").peak_bytes
    size = 1_000_000  # float64: 8 MB each

    def two_live_then_one() -> str:
        a = torch.ones(size, dtype=torch.float64)
        b = a * 2
        del a
        c = b + 1  # a freed first: at most two live
        del b, c
        return "done"

    result, peak = peak_bytes(two_live_then_one)
    assert result == "done"
    assert 16_000_000 <= peak < 16_100_000, peak
    assert peak_bytes(lambda: None) == (None, 0)


def test_moe_window_stats_exact_row_and_cost() -> None:
    bench = _load("moe_window_stats")
    torch.set_num_threads(1)
    got, want = bench._exact("mixtral", 1, 0, True), bench.reference("mixtral", True)
    assert float((got - want).norm() / want.norm()) < 1e-12
    pre, train, pre_peak, train_peak = bench._cost("mixtral", 1, 0, 1)
    assert 0 < pre and 0 < train
    # the pre-pass keeps no graph: its peak is below the training forwards and backwards'
    assert 0 < pre_peak < train_peak, (pre_peak, train_peak)


def test_moe_grpo_aux_rows(monkeypatch: Any) -> None:
    """docs/moe.md's GRPO table comes from ``benchmarks/moe_grpo.py``: its aux-alone rows on a
    tiny Mixtral (one window of 4 micro-batches here), against the benchmark's float64 full
    window: ExactGRPOTrainer to rounding, its pre-pass timed (the stock trainer's distance is
    tested in tests/integrations/test_trl_grpo.py)."""
    pytest.importorskip("trl")
    bench = _load("moe_grpo")
    monkeypatch.setattr(bench, "STEPS", 1)
    torch.set_num_threads(1)

    trainer = bench.train("mixtral", bench.ExactGRPOTrainer, 4, constant=True)
    row = [cell.strip() for cell in bench._row("mixtral", "-", trainer).strip("|").split("|")]
    assert float(row[2]) < 1e-12, row
    assert 0 < float(row[3]) < 1 and 0 < float(row[4]), row

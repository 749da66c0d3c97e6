"""Host synchronizations per window under DDP, 2 gloo ranks on the fake device of
``tests/_sync_cases.py``, with the collective tensors on the device as NCCL needs them.

Steady state (windows after the first): one read per window on every rank, at the step, with
or without a GradScaler; nothing per micro-batch; no host read when a window opens: the
window-start exchange is gathered on the device and left there (its gradients-present flag is
read with the step's numbers).

What stays, and why:

- the first window of ``acc.windows(loader)`` reads the gathered table when it opens (+1): a
  rank with no micro-batch and nothing to pad with must fail on every rank before any
  backward, and the first window's ``c`` comes from every rank's estimate;
- ``counts=`` reads the gathered totals when each window opens (+1): ``window.totals`` are
  numbers before the first backward;
- (not run here) ``partial_window="drop"``, FSDP2's equal micro-batch counts, DDP's static
  graph in its first window, a resumed state's position check and "auto" read the table when
  the window opens: each is a decision every rank must take before the first backward. A rank
  that ran out of data reads it too (to pad, or to end with the others); the others do not.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import _dist_cases as cases
import _dist_syncs
from _dist import run_ranks, values

pytestmark = pytest.mark.timeout(180)


def _reads(options: dict[str, Any]) -> list[list[dict[str, Any]]]:
    return values(run_ranks(_dist_syncs.ddp_host_reads, 2, options, deadline=150))


@pytest.mark.parametrize("scaler", [False, True], ids=["plain", "grad_scaler"])
def test_ddp_reads_once_per_window(scaler: bool) -> None:
    for rank, windows in enumerate(_reads({"scaler": scaler, "windows": 4})):
        assert len(windows) == 4
        first, *rest = windows
        assert first["open"] == 1 and first["step"] == 1, (rank, first["events"])
        for w in rest:
            assert w["micro"] == [0, 0] and w["h2d"] == [0, 0], (rank, w["events"])
            assert (w["open"], w["step"], w["window"]) == (0, 1, 1), (rank, w["events"])


def test_ddp_counts_read_once_when_the_window_opens() -> None:
    for rank, windows in enumerate(_reads({"counts": True, "windows": 3})):
        for w in windows[1:]:
            assert w["micro"] == [0, 0], (rank, w["events"])
            assert (w["open"], w["step"]) == (1, 1), (rank, w["events"])


def test_without_the_start_read_padding_stays_exact() -> None:
    """Rank 1 runs out of data in window 2: only it reads the window-start table (to pad);
    every step still equals the float64 full batch on the union of the data."""
    layout, k = [[3, 1, 4, 2, 5], [2, 6, 1]], 2
    results = values(run_ranks(_dist_syncs.lazy_start_train, 2, layout, k, deadline=150))
    reference = cases.reference_run(cases.reference_windows(layout, k))
    assert [r["paddings"] for r in results] == [[0, 0, 0], [0, 0, 1]]
    assert [r["opens"] for r in results] == [[1, 0, 0], [1, 0, 1]]
    for res in results:
        assert len(res["params"]) == len(reference)
        for got, mine, ref in zip(res["params"], results[0]["params"], reference, strict=True):
            assert torch.equal(got, mine)  # every rank, every step
            assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-10


def test_gradients_present_on_every_rank_refused_when_the_window_opens() -> None:
    results = run_ranks(_dist_syncs.grads_before_window, 2, [0, 1], pg_timeout=10, deadline=60)
    for res in results:
        assert res.error_type == "RuntimeError" and "already present" in res.error, res


def test_gradients_present_on_one_rank_fail_there_and_time_out_elsewhere() -> None:
    """The documented cost of not reading the table: the other rank fails at its next
    collective, within the process-group timeout, not at the window start."""
    results = run_ranks(_dist_syncs.grads_before_window, 2, [1], pg_timeout=5, deadline=60)
    assert results[1].error_type == "RuntimeError" and "already present" in results[1].error
    assert not results[0].ok and results[0].error_type != "Timeout", results[0]

"""A rank killed with SIGKILL inside DDP's uneven last window, and the job restarted from the
files every rank saved after every backward (tests/_dist_restart.py).

The newest file both ranks have pairs rank 0's state after its window's last backward with
rank 1's after its 2nd of 4 micro-batches. Under ``ddp_sync="last"`` that last backward
all-reduces across ranks: the pair must be refused on both ranks, before any collective, with
the same message, nothing changed; the previous files resume. Under ``ddp_sync="step"`` the
pair resumes bitwise equal to the uninterrupted run.
"""

from __future__ import annotations

import pytest
import torch

from _dist import run_ranks, values
from _dist_restart import restart, train_until_killed

pytestmark = pytest.mark.timeout(240)


def _kill(folder: str, ddp_sync: str) -> None:
    killed = run_ranks(train_until_killed, 2, folder, ddp_sync, pg_timeout=10.0, deadline=60.0)
    assert killed[1].exitcode == -9, (killed[1].error_type, killed[1].error)  # SIGKILL
    # rank 0 failed at its next collective (the step's), not by a timeout of the harness
    assert not killed[0].ok and killed[0].error_type not in ("Timeout", "AssertionError"), (
        killed[0].error_type,
        killed[0].error,
    )


def test_killed_rank_restart_refuses_a_pair_across_the_last_backward(tmp_path) -> None:
    folders = {mode: tmp_path / mode for mode in ("last", "step")}
    for mode, folder in folders.items():
        folder.mkdir()
        _kill(str(folder), mode)

    last = values(run_ranks(restart, 2, str(folders["last"]), "last", pg_timeout=10.0))
    assert [(r["done"], r["final"]) for r in last] == [(2, True), (2, False)]
    messages = [r["refused"] for r in last]
    assert messages[0] is not None and messages[0] == messages[1], messages  # one text
    assert messages[0].startswith(
        "ResumeMismatch: The ranks loaded states from different points of the same window"
    ), messages[0]
    assert (
        "rank(s) [0] after their last backward of the window (2 micro-batch(es) done), "
        in (messages[0])
    )
    assert "rank(s) [1] would run that all-reduce alone" in messages[0], messages[0]
    for rank, res in enumerate(last):
        assert res["unchanged"], rank
        assert "inside a window with ddp_sync='last'" in res["other_sync"], res["other_sync"]
        assert res["index"] == 5  # the previous files: both before rank 0's last backward
        assert torch.equal(res["resumed"], res["uninterrupted"]), rank

    step = values(run_ranks(restart, 2, str(folders["step"]), "step", pg_timeout=10.0))
    assert [(r["done"], r["final"]) for r in step] == [(2, True), (2, False)]
    for rank, res in enumerate(step):
        assert res["refused"] is None and res["index"] == 6, (rank, res["refused"])
        assert torch.equal(res["resumed"], res["uninterrupted"]), rank
    assert torch.equal(step[0]["resumed"], step[1]["resumed"])

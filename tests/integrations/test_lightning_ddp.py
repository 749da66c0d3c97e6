"""``ExactAccumulation`` under Lightning's ``strategy="ddp"`` on 2 gloo ranks (CPU).

The ranks are started by ``tests/_dist.py`` (FileStore, no ports); each builds a Trainer whose
cluster environment says the processes already exist, so Lightning launches nothing and keeps
the process group it finds. Ranks hold different numbers of rows and tokens per micro-batch,
and the epoch ends on a partial window. After every step, every rank's parameters must equal
a plain float64 full-batch run over both ranks' rows of that window.
"""

from __future__ import annotations

import math
import tempfile

import pytest

pytest.importorskip("lightning.pytorch")

import _lightning_cases as cases
from _dist import run_ranks, values

pytestmark = pytest.mark.timeout(120)

K = 4
SIZES = [[3, 1, 4, 2, 5, 1], [1, 6, 1, 2, 2, 3]]  # rows per micro-batch, per rank: 6 = 4 + 2


def _setup() -> tuple[list[list[cases.Batch]], list[list[cases.torch.Tensor]]]:
    rows = [cases.make_rows(sum(s), seed=10 + r) for r, s in enumerate(SIZES)]
    per_rank = [cases.micro_batches(rows[r], SIZES[r]) for r in range(2)]

    def window_rows(r: int, w: int) -> list[cases.torch.Tensor]:
        start = sum(SIZES[r][: w * K])
        return rows[r][start : start + sum(SIZES[r][w * K : (w + 1) * K])]

    windows = [window_rows(0, w) + window_rows(1, w) for w in range(2)]
    return per_rank, windows


def test_ddp_two_ranks_uneven_counts_match_the_full_batch_every_step() -> None:
    per_rank, windows = _setup()
    losses: list[float] = []
    ref = cases.reference(cases.tiny_lm(0).double(), windows, losses=losses)
    with tempfile.TemporaryDirectory() as root:
        got = values(run_ranks(cases.ddp_rank, 2, per_rank, K, root, deadline=90))
    for exact, last_loss, plain in got:
        assert len(exact) == 2  # a full window and the partial one
        assert cases.max_diff(exact, ref) < 1e-12
        # the window loss over both ranks' tokens, the same on every rank
        assert math.isclose(last_loss, losses[-1], rel_tol=1e-12)
        # Lightning's own accumulation of a mean loss, same ranks and data: visibly off.
        assert cases.max_diff(plain, ref) > 1e-3


def test_ddp_under_the_standalone_pytorch_lightning_package() -> None:
    """The same run with `pytorch_lightning.Trainer` and its DDPStrategy (both packages are
    installed here): the callback takes the strategy classes from the Trainer's package."""
    pytest.importorskip("pytorch_lightning")
    per_rank, windows = _setup()
    ref = cases.reference(cases.tiny_lm(0).double(), windows)
    with tempfile.TemporaryDirectory() as root:
        got = values(
            run_ranks(cases.ddp_rank, 2, per_rank, K, root, "pytorch_lightning", False, deadline=90)
        )
    for exact, _, _ in got:
        assert len(exact) == 2
        assert cases.max_diff(exact, ref) < 1e-12

"""fullbatch on Accelerate-prepared objects over 2 gloo ranks: the prepared model is DDP,
the prepared loader shards batches over ranks. Every rank's parameters after every step equal
a single-process float64 full batch over both ranks' rows; one gradient sync per window.

Accelerate's PartialState reads RANK / WORLD_SIZE / LOCAL_RANK and uses the process group
that tests/_dist.py already initialized (a FileStore: no port)."""

from __future__ import annotations

import pytest

import _accelerate_cases as cases
from _dist import run_ranks, values
from conftest import make_lm, rel_err

pytest.importorskip("accelerate")
pytestmark = pytest.mark.timeout(120)


def batches(n_rows: int) -> list[list[int]]:
    rows = list(range(n_rows))
    return [rows[i : i + cases.MICRO_ROWS] for i in range(0, n_rows, cases.MICRO_ROWS)]


@pytest.mark.parametrize(
    ("n_rows", "even_batches"),
    [(44, False), (48, True)],
    ids=["44-rows-even_batches=False", "48-rows-default"],
)
def test_prepared_ddp_steps_like_the_full_batch(n_rows: int, even_batches: bool) -> None:
    """44 rows = 11 batches of 4: rank 0 reads 6, rank 1 reads 5 (uneven ranks and tokens);
    48 rows split evenly, where the default even_batches=True adds nothing."""
    r0, r1 = values(run_ranks(cases.ddp_rank, 2, n_rows, even_batches))
    assert r0["ddp"] and r0["processes"] == 2
    b = batches(n_rows)
    # Accelerate deals batches round-robin: rank r gets batches r, r + 2, ...
    assert r0["read"] == [i for batch in b[0::2] for i in batch]
    assert r1["read"] == [i for batch in b[1::2] for i in batch]
    # A window is 4 micro-batches per rank: 8 batches, then what is left.
    assert [sorted(a + b) for a, b in zip(r0["windows"], r1["windows"], strict=True)] == [
        list(range(32)),
        list(range(32, n_rows)),
    ]
    data = cases.rows(n_rows)
    # The AcceleratedScheduler steps StepLR twice per optimizer step (num_processes).
    want = cases.reference_run(make_lm(), [data[:32], data[32:]], gamma=0.5, scheduler_steps=2)
    for r in (r0, r1):
        assert r["last_epoch"] == 4
        assert r["micro"] == [4, len(r["windows"][1]) // cases.MICRO_ROWS]
        for step, (got, ref) in enumerate(zip(r["params"], want, strict=True)):
            assert rel_err(got, ref) < 1e-12, f"rank {r['read'][0]} step {step}"
        assert r["grad_syncs"] == 2  # one gradient all-reduce per window (one DDP bucket)
    assert r0["micro"] == [4, 2] and r1["micro"] == [4, 2 if n_rows == 48 else 1]


def test_even_batches_default_repeats_rows_and_is_refused() -> None:
    """44 rows with the default even_batches=True: Accelerate gives rank 1 a 6th batch made of
    rows 0-3 again, so 4 rows would count twice. Both ranks refuse at acc.windows()."""
    r0, r1 = values(run_ranks(cases.ddp_rank, 2, 44, True))
    b = batches(44)
    assert r0["read"] == [i for batch in b[0::2] for i in batch]
    assert r1["read"] == [i for batch in b[1::2] for i in batch] + [0, 1, 2, 3]
    for r in (r0, r1):
        assert "adds 4 row(s) from the start of the data to its 44 rows" in r["error"]
        assert "DataLoaderConfiguration(even_batches=False)" in r["error"]


def test_leftover_accumulate_that_unsyncs_ddp_raises_on_every_rank() -> None:
    """Accelerate's accumulate() entered no_sync() on the window's final micro-batch: the
    ranks' gradients were never averaged (they differ), so stepping would diverge the ranks.
    Every rank refuses at window.step() and no parameter moves."""
    r0, r1 = values(run_ranks(cases.ddp_leftover_accumulate, 2))
    assert (r0["grad"] - r1["grad"]).abs().max() > 1e-3  # not synchronized
    for r in (r0, r1):
        assert "sync_gradients is False" in r["error"]
        assert "gradient_accumulation_steps=3" in r["error"]
        assert not r["moved"]

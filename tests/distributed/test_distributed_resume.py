"""Resume under DDP and FSDP2 on 2 gloo ranks: every rank saves its own state mid-window (or at
a boundary); fresh objects load it and finish the run; every rank's parameters equal the
uninterrupted run's to 1e-12 (float64, dropout, AdamW)."""

from __future__ import annotations

import pytest
import torch

import _resume_cases as cases
from _dist import run_ranks, values
from _dist_cases import reference_run, reference_windows

pytestmark = pytest.mark.timeout(180)

# Per rank, the rows of its micro-batches: with K=3, windows of 3, 3 and a partial tail
# (1 micro-batch on rank 0, 2 on rank 1).
LAYOUT = [[3, 1, 4, 2, 5, 2, 3], [2, 6, 1, 3, 2, 4, 1, 2]]
# Where every rank saves: after window 1's step, after 1 and 2 of its 3 micro-batches, and
# after the first micro-batch of the tail window. That last point is one where both ranks
# stand only when no backward synchronizes there: under DDP's default rank 0's only tail
# micro-batch synchronizes with rank 1's second, so rank 1 cannot save before it.
STOPS = [(1, None), (1, 1), (1, 2)]
CASES = [
    *[("ddp", {}, stop) for stop in STOPS],
    *[("ddp", {"ddp_sync": "step"}, stop) for stop in [*STOPS, (2, 1)]],
    *[("fsdp", {"fsdp_sync": "micro_batch"}, stop) for stop in [*STOPS, (2, 1)]],
]


@pytest.mark.parametrize(("wrapper", "options", "stop"), CASES)
def test_resume_equals_uninterrupted(wrapper: str, options: dict, stop: tuple) -> None:
    spec = {"wrapper": wrapper, "layout": LAYOUT, "k": 3, "options": options, "stop": stop}
    results = values(run_ranks(cases.resume_run, 2, spec))
    for rank, res in enumerate(results):
        got, want = res["resumed"], res["uninterrupted"]
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err < 1e-12, f"rank {rank}: resumed run off by {err:.3g}"
        assert torch.equal(results[0]["resumed"], got)  # every rank holds the same model
        assert res["loader_items"] == (6 if stop[0] == 2 or stop[1] is None else 3)
        if stop[1] is not None:
            assert res["done"] == stop[1] and res["grads"]  # gradients travelled


def test_a_loader_at_the_wrong_position_on_one_rank_is_refused_on_every_rank() -> None:
    """Rank 1 resumes one item late: both ranks raise (the window-start exchange carries the
    check), nothing changes, and the correct resume that follows equals the uninterrupted run."""
    spec = {"wrapper": "ddp", "layout": LAYOUT, "k": 3, "options": {}, "stop": (1, 2)}
    spec["wrong_rank"] = 1
    results = values(run_ranks(cases.resume_run, 2, spec))
    assert results[0]["refused"] == results[1]["refused"]  # one message, word for word
    for res in results:
        assert res["refused"].startswith(
            "On rank(s) [1]: the loader given to acc.windows() does not start at "
            "state['loader_items'] = 3 (its first item is not the item saved at 3"
        ), res["refused"]
        got, want = res["resumed"], res["uninterrupted"]
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-12


@pytest.mark.parametrize(
    ("wrapper", "options"), [("ddp", {}), ("fsdp", {"fsdp_sync": "micro_batch"})]
)
def test_resumed_run_is_the_full_batch_run(wrapper: str, options: dict) -> None:
    """No dropout, SGD with momentum: the resumed run's parameters are the plain float64
    full-batch run's on the union of both ranks' data."""
    spec = {"wrapper": wrapper, "layout": LAYOUT, "k": 3, "options": options, "stop": (1, 2)}
    spec["plain"] = True
    want = reference_run(reference_windows(LAYOUT, 3))[-1]
    for res in values(run_ranks(cases.resume_run, 2, spec)):
        err = ((res["resumed"] - want).abs().max() / want.abs().max()).item()
        assert err < 1e-12, err


def test_fsdp_boundary_resume_with_window_sync() -> None:
    spec = {"wrapper": "fsdp", "layout": LAYOUT, "k": 3, "options": {}, "stop": (1, None)}
    for res in values(run_ranks(cases.resume_run, 2, spec)):
        got, want = res["resumed"], res["uninterrupted"]
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-12


def test_fsdp_window_sync_refuses_a_mid_window_state() -> None:
    for message in values(run_ranks(cases.fsdp_window_refuses, 2)):
        assert "fsdp_sync='micro_batch'" in message


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp"])
def test_a_single_process_state_is_refused(wrapper: str) -> None:
    for message in values(run_ranks(cases.refused_world, 2, wrapper)):
        assert "world_size=1" in message and "world_size=2" in message


@pytest.mark.fsdp2
def test_resume_checks_raise_on_every_rank_and_the_right_resume_is_bitwise(tmp_path) -> None:
    """One 2-rank group (tests/_dist_resume_checks.py): FSDP2 with DCP, a state taken after a
    padding micro-batch; an older Accumulator state on one rank (another window, or another
    point of the same window), an optimizer or a model left unloaded on one rank: every rank
    raises ValueError (none waits for the 10 s process-group timeout); the right resume is
    bitwise the uninterrupted run on every rank. DDP: an older window's state on one rank.
    DCP's own optimizer step inside window 0 is let through and changes nothing."""
    from _dist_resume_checks import resume_checks

    results = run_ranks(resume_checks, 2, str(tmp_path), pg_timeout=10.0, deadline=150.0)
    expected = {
        "older_window": "The ranks loaded the states of different windows (acc.steps=1 on "
        "rank(s) [0], acc.steps=0 on rank(s) [1])",
        "older_point": "The ranks loaded states from different points of the same window (3 "
        "micro-batch(es) done on rank(s) [0], 1 micro-batch(es) done on rank(s) [1])",
        "optimizer_template": "On rank(s) [1]: the optimizer's state",
        "model_unloaded": "On rank(s) [0]: the model's parameters are not the ones saved",
        "ddp_older_window": "The ranks loaded the states of different windows (acc.steps=1 on "
        "rank(s) [0], acc.steps=0 on rank(s) [1])",
    }
    every = values(results)
    for rank, res in enumerate(every):
        for name, text in expected.items():
            assert res[name] == every[0][name], (name, every)  # the same message on every rank
            assert res[name].startswith(f"ResumeMismatch: {text}"), (rank, name, res[name])
        assert res["done"] == 3 and res["loader_items"] == 4  # rank 0: 2 real + 1 padding
        assert torch.equal(res["resumed"], res["uninterrupted"]), rank
        assert res["dcp_in_window"], rank

"""The resume check's refusal, written from the window-start exchange's rows alone (so the same
on every rank): which pairs of states it refuses, and what it says first.

The rows here are what two ranks would exchange; tests/distributed/test_distributed_restart.py
and test_distributed_resume.py run the same cases for real on 2 gloo ranks.
"""

from __future__ import annotations

import pytest

from fullbatch._engine._resume_texts import (
    DATA,
    DONE,
    FINAL,
    ITEMS,
    LOADED,
    MODEL,
    MODEL_DIFF,
    OPTIMIZER,
    POSITION,
    PROBLEMS,
    PROGRESS_NOW,
    PROGRESS_SAVED,
    STEPS,
    WIDTH,
    refusal,
)

NAMES = ["0.weight", "0.bias"]


def row(
    *, loaded: bool = True, steps: int = 1, done: int = 0, final: bool = False, problems: int = 0
) -> list[float]:
    r = [0.0] * WIDTH
    r[LOADED], r[STEPS], r[DONE], r[FINAL], r[PROBLEMS] = loaded, steps, done, final, problems
    r[PROGRESS_NOW : PROGRESS_NOW + 2] = [2.0, 1.0]
    r[PROGRESS_SAVED : PROGRESS_SAVED + 2] = [2.0, 1.0]
    r[MODEL_DIFF : MODEL_DIFF + 4] = [0.0, -1.0, -1.0, -1.0]
    return r


def say(rows: list[list[float]], have: list[int], *, in_backward: bool) -> str:
    return refusal(rows, have, NAMES, equal=False, in_backward=in_backward)


# Rank 0 after its last backward (2 of 2), rank 1 after 2 of its 4 micro-batches: the pair a
# restart from "the newest file every rank has" picks after a kill in DDP's uneven last window.
ACROSS = [row(done=2, final=True), row(done=2)]


def test_a_pair_across_the_last_backward_is_refused_where_it_all_reduces() -> None:
    text = say(ACROSS, [2, 4], in_backward=True)
    assert text.startswith(
        "The ranks loaded states from different points of the same window: rank(s) [0] after "
        "their last backward of the window (2 micro-batch(es) done), rank(s) [1] before theirs "
        "(2 micro-batch(es) done). With DDP's ddp_sync='last' that last backward all-reduces"
    ), text
    assert "rank(s) [1] would run that all-reduce alone" in text
    assert text.endswith("Nothing was changed: fix this and call acc.windows() again.")


def test_the_same_pair_resumes_where_no_backward_reduces() -> None:
    assert say(ACROSS, [2, 4], in_backward=False) == ""  # ddp_sync="step"


@pytest.mark.parametrize(
    "rows",
    [
        [row(done=2, final=True), row(done=0)],  # rank 1 at the window's start
        [row(done=1, final=True), row(done=1), row(done=1)],  # three ranks, one finished
    ],
)
def test_any_rank_still_before_its_last_backward_is_refused(rows: list[list[float]]) -> None:
    assert "would run that all-reduce alone" in say(rows, [4] * len(rows), in_backward=True)


def test_every_rank_finished_or_none_resumes() -> None:
    finished = [row(done=2, final=True), row(done=4, final=True)]  # uneven, both finished
    assert say(finished, [2, 4], in_backward=True) == ""
    inside = [row(done=1), row(done=1)]
    assert say(inside, [2, 4], in_backward=True) == ""


def test_a_stale_file_gives_its_cause_first_and_no_misleading_fix() -> None:
    """Rank 1 loaded the previous window's state beside the newest model and optimizer: the
    cause is the stale file; that its model, optimizer and loader do not fit follows from it."""
    stale = row(steps=0, done=2, problems=OPTIMIZER | MODEL | DATA)
    stale[ITEMS], stale[POSITION] = 4.0, 3.0
    text = say([row(done=2), stale], [4, 4], in_backward=True)
    assert text.startswith(
        "The ranks loaded the states of different windows (acc.steps=1 on rank(s) [0], "
        "acc.steps=0 on rank(s) [1]): every rank must load its own state from the same "
        "checkpoint"
    ), text
    assert (
        "on rank(s) [1] the optimizer's state, the model's parameters and the loader's "
        "position do(es) not fit the state loaded there"
    ) in text
    assert "Load the optimizer's state" not in text and "Load the model's" not in text


def test_one_rank_problem_names_the_rank_then_the_fix() -> None:
    bad = row(done=2, problems=MODEL)
    bad[MODEL_DIFF : MODEL_DIFF + 4] = [2.0, 0.0, 1.0, -1.0]
    text = say([row(done=2), bad], [4, 4], in_backward=True)
    assert text.startswith(
        "On rank(s) [1]: the model's parameters are not the ones saved with this state: 2 of "
        "2 trained parameter(s) (0.weight, 0.bias) differ."
    ), text
    assert text.index("differ.") < text.index("Load the model's state saved")


def test_an_optimizer_given_a_state_before_the_first_step_is_told_to_stay_fresh() -> None:
    """Saved before the first step (no optimizer state); DCP's get_state_dict gave the resumed
    optimizer one (docs/checkpointing.md, the pitfalls before the first step)."""
    rows = [row(steps=0, done=2, problems=OPTIMIZER) for _ in range(2)]
    for r in rows:
        r[PROGRESS_SAVED : PROGRESS_SAVED + 2] = [0.0, -1.0]
        r[PROGRESS_NOW : PROGRESS_NOW + 2] = [4.0, 1.0]
    text = say(rows, [3, 3], in_backward=False)
    assert text.startswith(
        "On rank(s) [0, 1]: the optimizer's state does not match the loaded Accumulator state "
        "(acc.steps = 0): the optimizer holds state for 4 parameter(s) at step 1, the run that "
        "saved it held state for 0: it had not stepped yet"
    ), text
    assert "Leave the optimizer fresh" in text and "Load the optimizer's state" not in text

"""The resume check's refusals, written from the rows of the window-start exchange alone.

Every rank holds every rank's row (:mod:`fullbatch._engine._start`), the same parameter names
and the same sync, and writes its message from nothing else: a refusal reads the same, word
for word, in every rank's log. So a row carries, beside its flags, the numbers the messages
show: the scheduler's epochs, the optimizer's progress, the first parameters whose sums
differ, the loader position. Each message gives the cause, then the fix; a disagreement
between ranks (a rank that loaded an older file) comes before the problems one rank finds on
its own, which it often explains.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from fullbatch._engine._checkpoint import AT_END, PAST_END

__all__ = [
    "DATA",
    "DONE",
    "EPOCH_NOW",
    "EPOCH_THEN",
    "FINAL",
    "ITEMS",
    "LOADED",
    "MODEL",
    "MODEL_DIFF",
    "NO_STATE",
    "OPTIMIZER",
    "OPTIMIZER_DIFF",
    "POSITION",
    "PROBLEMS",
    "PROGRESS_NOW",
    "PROGRESS_SAVED",
    "SCHEDULER",
    "SHOWN",
    "SKIPPED",
    "STEPS",
    "WIDTH",
    "refusal",
]

# Problems one rank finds on its own (bits of its row's PROBLEMS slot).
SCHEDULER, NO_STATE, OPTIMIZER, MODEL, DATA = 1, 2, 4, 8, 16
SHOWN = 3  # parameter names shown in a message
# Slots of a rank's row.
LOADED, STEPS, SKIPPED, DONE, FINAL, PROBLEMS = range(6)
EPOCH_NOW, EPOCH_THEN = 6, 7  # the scheduler's last_epoch now; when saved (or built: NO_STATE)
PROGRESS_NOW, PROGRESS_SAVED = 8, 10  # the optimizer's progress, 2 slots each (NaN: unknown)
OPTIMIZER_DIFF = 12  # parameters whose optimizer state differs: their number, SHOWN indices
MODEL_DIFF = OPTIMIZER_DIFF + 1 + SHOWN  # parameters that differ: their number, SHOWN indices
ITEMS = MODEL_DIFF + 1 + SHOWN  # state["loader_items"]
POSITION = ITEMS + 1  # where the loader stands (_checkpoint.position)
WIDTH = POSITION + 1

Row = list[float]


# -- the whole refusal ---------------------------------------------------------------------------


def refusal(
    rows: list[Row], have: list[int], names: list[str], *, equal: bool, in_backward: bool
) -> str:
    """The message every rank raises ("" when every rank's state fits).

    ``have``: every rank's micro-batches in the resumed window, padding included; ``names``:
    the trained parameters' names; ``equal``: every rank runs equally many micro-batches (the
    points must match on every rank); ``in_backward``: the wrapper reduces inside a rank's
    last backward (then every rank has finished its window, or none has).
    """
    loaded = any(r[LOADED] for r in rows)
    windows = _by_value([f"acc.steps={int(r[STEPS])}" + _skipped(r) for r in rows])
    if loaded and len(windows) > 1:
        # The cause: the rest (a model or an optimizer that does not fit) follows from it.
        found = [_different_windows(windows), _consequences(rows)]
    else:
        across = _disagreement(rows, have, equal, in_backward) if loaded else ""
        found = [across, *_problems(rows, names)]
    text = " ".join(f for f in found if f)
    return text + " Nothing was changed: fix this and call acc.windows() again." if text else ""


# -- across ranks --------------------------------------------------------------------------------


def _different_windows(windows: dict[str, list[int]]) -> str:
    return (
        f"The ranks loaded the states of different windows ({_show(windows)}): every rank "
        "must load its own state from the same checkpoint, saved at the same point of the "
        "loop (a rank that loaded an older state, or none, would wait for the others in a "
        "collective until the process group's timeout)."
    )


_WHAT = {
    SCHEDULER: "the scheduler's last_epoch",
    NO_STATE: "a scheduler loaded without an Accumulator state",
    OPTIMIZER: "the optimizer's state",
    MODEL: "the model's parameters",
    DATA: "the loader's position",
}


def _consequences(rows: list[Row]) -> str:
    """What the ranks found that a state from another window explains, in one sentence."""
    found = _by_value(
        [_listing([w for bit, w in _WHAT.items() if int(r[PROBLEMS]) & bit]) for r in rows]
    )
    parts = [f"on rank(s) {ranks} {what}" for what, ranks in found.items() if what]
    if not parts:
        return ""
    return f"As expected then, {'; '.join(parts)} do(es) not fit the state loaded there."


def _listing(items: list[str]) -> str:
    """``"a"``, ``"a and b"``, ``"a, b and c"``."""
    return " and ".join([", ".join(items[:-1]), items[-1]] if len(items) > 1 else items)


def _disagreement(rows: list[Row], have: list[int], equal: bool, in_backward: bool) -> str:
    """Why the states of one window do not belong together ("" when they do)."""
    finished = [r for r, row in enumerate(rows) if row[FINAL]]
    if in_backward and not equal and 0 < len(finished) < len(rows):
        return _across_last_backward(rows, finished)
    inside = [r for r in rows if equal or not r[FINAL]]
    if len({r[DONE] for r in inside}) > 1:
        return (
            "The ranks loaded states from different points of the same window "
            f"({_show(_by_value([_done(r) for r in rows]))}): every rank must load its own "
            "state from the same checkpoint, saved after the same micro-batch (a rank that "
            "runs more micro-batches than the others would wait for them in a collective)."
        )
    short = [r for r, row in enumerate(rows) if have[r] < row[DONE]]
    if not short or any(int(r[PROBLEMS]) & DATA for r in rows):  # the position says so already
        return ""
    where = f" on rank(s) {short}" if len(rows) > 1 else ""
    return (
        f"The resumed window has only {have[short[0]]} micro-batch(es){where} but the state "
        f"was taken after {int(rows[short[0]][DONE])}: the loader does not start at "
        "state['loader_items'] or yields different items. Give acc.windows() the loader from "
        "that item on."
    )


def _across_last_backward(rows: list[Row], finished: list[int]) -> str:
    others = [r for r in range(len(rows)) if r not in finished]
    return (
        "The ranks loaded states from different points of the same window: "
        f"rank(s) {finished} after their last backward of the window "
        f"({_points(rows, finished)}), rank(s) {others} before theirs "
        f"({_points(rows, others)}). With DDP's ddp_sync='last' that last backward "
        "all-reduces the gradients of every rank together, so no rank can resume after it "
        f"while another resumes before it: rank(s) {others} would run that all-reduce alone "
        "(a collective mismatch: a crash, or a hang). Every rank must load its own state "
        "from the same point: after the window's last backward on every rank, or before it "
        "on every rank (e.g. every rank's previous file). (Under ddp_sync='step', which "
        "all-reduces at step() only, such states resume exactly.)"
    )


def _done(row: Row) -> str:
    return f"{int(row[DONE])} micro-batch(es) done"


def _points(rows: list[Row], ranks: list[int]) -> str:
    points = _by_value([_done(rows[r]) for r in ranks])
    if len(points) == 1:
        return next(iter(points))
    return ", ".join(f"{p} on rank(s) {[ranks[i] for i in at]}" for p, at in points.items())


# -- one rank's problems -------------------------------------------------------------------------

Say = Callable[[Row, list[str]], str]


def _problems(rows: list[Row], names: list[str]) -> list[str]:
    """One message per problem found on some rank: the cause on each rank, then the fix."""
    found = []
    for bit, (cause, fix) in _TEXTS.items():
        ranks = [r for r, row in enumerate(rows) if int(row[PROBLEMS]) & bit]
        if not ranks:
            continue
        causes = _by_value([cause(rows[r], names) for r in ranks])
        if len(rows) == 1:
            said = [text[:1].upper() + text[1:] + "." for text in causes]
        else:
            said = [f"On rank(s) {[ranks[i] for i in at]}: {text}." for text, at in causes.items()]
        found.append(" ".join([*said, fix([rows[r] for r in ranks])]))
    return found


def _scheduler(row: Row, names: list[str]) -> str:
    return (
        f"the scheduler's last_epoch is {_epoch(row[EPOCH_NOW])} but was "
        f"{_epoch(row[EPOCH_THEN])} when the state was saved"
    )


def _no_state(row: Row, names: list[str]) -> str:
    return (
        f"the scheduler's last_epoch moved from {_epoch(row[EPOCH_THEN])} to "
        f"{_epoch(row[EPOCH_NOW])} after this Accumulator was built and before its first "
        "window, but no Accumulator state was loaded: the scheduler's state was loaded "
        "(scheduler.load_state_dict) and the Accumulator's was not"
    )


def _optimizer(row: Row, names: list[str]) -> str:
    now = row[PROGRESS_NOW : PROGRESS_NOW + 2]
    saved = row[PROGRESS_SAVED : PROGRESS_SAVED + 2]
    if not math.isnan(saved[0]) and saved != now:
        return (
            "the optimizer's state does not match the loaded Accumulator state (acc.steps = "
            f"{int(row[STEPS])}): the optimizer holds state for {int(now[0])} parameter(s)"
            f"{_steps(now)}, the run that saved it held state for {int(saved[0])}"
            f"{_steps(saved)}" + (_GIVEN_A_STATE if _given_a_state(row) else "")
        )
    return (
        "the optimizer's state is not the one saved with this state: the state of "
        f"{_names(row, OPTIMIZER_DIFF, names)} differs, though it holds state for "
        f"{int(now[0])} parameter(s){_steps(now)} as the saving run did. It was not loaded "
        "(DCP's get_state_dict(model, optimizer) gives a fresh optimizer a zeroed state at "
        "step 1), or was loaded from another checkpoint"
    )


_GIVEN_A_STATE = (
    ": it had not stepped yet, and this one was given a state, e.g. by DCP's get_state_dict "
    "or set_state_dict, which step an optimizer without a state with every learning rate 0"
)


def _given_a_state(row: Row) -> bool:
    """The saving run's optimizer had no state; this one has one."""
    return row[PROGRESS_SAVED] == 0 < row[PROGRESS_NOW]


def _optimizer_fix(rows: list[Row]) -> str:
    if all(_given_a_state(r) for r in rows):
        return (
            "Leave the optimizer fresh, as it was when the state was saved: before the first "
            "step load the model alone (get_model_state_dict, dcp.load, set_model_state_dict; "
            "docs/checkpointing.md)."
        )
    return (
        _load_fix("optimizer's state", "optimizer.load_state_dict(...)")(rows)
        + " A fresh optimizer (no momentum, no Adam moments, step 0) trains differently from "
        "the uninterrupted run."
    )


def _model(row: Row, names: list[str]) -> str:
    return (
        "the model's parameters are not the ones saved with this state: "
        f"{_names(row, MODEL_DIFF, names)} differ. The model's state was not loaded, or was "
        "loaded from another checkpoint (an older one?)"
    )


def _data(row: Row, names: list[str]) -> str:
    n, where = int(row[ITEMS]), int(row[POSITION])
    if where == PAST_END:
        here = "the state was saved after the loader's last item, but it yields more"
    elif where == AT_END:
        here = f"it yields nothing, but the state expects item {n}"
    else:
        here = f"its first item is not the item saved at {n}: their fingerprints differ"
    return (
        f"the loader given to acc.windows() does not start at state['loader_items'] = {n} ({here})"
    )


def _load_fix(what: str, how: str) -> Callable[[list[Row]], str]:
    return lambda rows: (
        f"Load the {what} saved at the same moment as this Accumulator state, before "
        f"acc.windows(loader) ({how}; under FSDP2 dcp.load(...) then set_state_dict(model, "
        "optimizer, model_state_dict=..., optim_state_dict=...))."
    )


def _data_fix(rows: list[Row]) -> str:
    items = {int(r[ITEMS]) for r in rows}
    n = str(items.pop()) if len(items) == 1 else "state['loader_items']"
    return (
        "Resuming from another position trains on other data (items skipped or seen twice) "
        f"without any error. Give acc.windows() the loader from item {n} on, e.g. "
        f"itertools.islice(loader, {n}, None) or a sampler resumed at that item (each rank "
        "its own)."
    )


_TEXTS: dict[int, tuple[Say, Callable[[list[Row]], str]]] = {
    SCHEDULER: (
        _scheduler,
        lambda rows: (
            "Load the scheduler's state_dict too (scheduler.load_state_dict(...)) "
            "before acc.windows(loader)."
        ),
    ),
    NO_STATE: (
        _no_state,
        lambda rows: (
            "Load it too, before acc.windows(loader): acc.load_state_dict(state) with "
            "the state saved by acc.state_dict() next to the scheduler's; it holds the step count "
            "and the loader position (state['loader_items']). (If you stepped the scheduler "
            "yourself before training, build the Accumulator after that.)"
        ),
    ),
    OPTIMIZER: (_optimizer, _optimizer_fix),
    MODEL: (_model, _load_fix("model's state", "model.load_state_dict(...)")),
    DATA: (_data, _data_fix),
}


# -- formatting ----------------------------------------------------------------------------------


def _epoch(value: float) -> str:
    return "None" if math.isnan(value) else str(int(value))


def _names(row: Row, slot: int, names: list[str]) -> str:
    count = int(row[slot])
    shown = [int(i) for i in row[slot + 1 : slot + 1 + SHOWN] if i >= 0]
    listed = [names[i] if i < len(names) else f"<parameter {i}>" for i in shown]
    more = ", ..." if count > len(listed) else ""
    return f"{count} of {len(names)} trained parameter(s) ({', '.join(listed)}{more})"


def _steps(progress: list[float]) -> str:
    return f" at step {int(progress[1])}" if progress[1] >= 0 else ""


def _skipped(row: Row) -> str:
    return f", skipped_windows={int(row[SKIPPED])}" if row[SKIPPED] else ""


def _by_value(values: list[str]) -> dict[str, list[int]]:
    """Each value with the indices that have it, in the order of first appearance."""
    at: dict[str, list[int]] = {}
    for index, value in enumerate(values):
        at.setdefault(value, []).append(index)
    return at


def _show(groups: dict[str, list[int]]) -> str:
    """``"a on rank(s) [0, 2], b on rank(s) [1]"``."""
    return ", ".join(f"{value} on rank(s) {ranks}" for value, ranks in groups.items())

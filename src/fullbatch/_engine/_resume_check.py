"""What a loaded state expects, checked on every rank and agreed before anything changes.

A state from ``acc.state_dict()`` expects the objects around it as they were when it was
saved. The first window of ``acc.windows(loader)`` after ``acc.load_state_dict(state)`` checks
that before anything changes:

- on each rank: the scheduler's ``last_epoch``; the optimizer's progress and the
  :func:`~fullbatch._base._fingerprint.tensor_sums` of its state (a state not loaded, DCP's
  zeroed template from ``get_state_dict``, or another checkpoint's differ); the sums of the
  model's trained parameters (not loaded, or loaded from another checkpoint); the loader item
  at ``loader_items``; and, with no state loaded, a scheduler moved since the Accumulator was
  built (its state was loaded, the Accumulator's was not);
- across ranks: every rank loaded the state of the same window (``steps``,
  ``skipped_windows``) and of the same point in it (micro-batches done: the same on every rank
  where ranks run equally many micro-batches, FSDP2; elsewhere the same on every rank still
  inside its window), and every rank's resumed window is long enough (its real micro-batches
  plus the padding the exchange gives it).

This rank's result is one row of the window-start exchange
(:func:`fullbatch._engine._start.start_window`), so a problem on one rank raises on every rank
(:class:`ResumeMismatch`, with the same causes), none left waiting in a collective.
``loader_items`` is not compared across ranks: a rank whose data ran out has consumed fewer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from fullbatch._engine._checkpoint import (
    check_position,
    fingerprints,
    optimizer_progress,
    wrong_position,
)
from fullbatch._engine._core import Engine
from fullbatch._engine._feed import Feed

__all__ = ["NO_STATE", "WIDTH", "ResumeCheck", "ResumeMismatch"]

# Problems one rank finds on its own (bits of its row's _PROBLEMS slot).
SCHEDULER, NO_STATE, OPTIMIZER, MODEL, DATA = 1, 2, 4, 8, 16
# Slots of this rank's row in the window-start exchange.
_LOADED, _STEPS, _SKIPPED, _DONE, _FINAL, _PROBLEMS = range(6)
WIDTH = 6
_SHOWN = 3  # parameter names shown in a message


class ResumeMismatch(ValueError, RuntimeError):
    """A loaded state does not fit the objects around it, or the other ranks' states.

    A ``ValueError`` (what was loaded is wrong) and, as the scheduler, optimizer and window
    length checks it gathers always were, a ``RuntimeError``: catch either.
    """


@dataclass(eq=False)
class ResumeCheck:
    """This rank's side of the checks at one window start (every window; the work only after
    a load)."""

    engine: Engine
    names: list[str]
    first_item: Any
    problems: int = 0
    model_diff: list[str] = field(default_factory=list)
    optimizer_diff: list[str] = field(default_factory=list)

    @classmethod
    def local(cls, engine: Engine, names: list[str], feed: Feed, first_item: Any) -> ResumeCheck:
        check = cls(engine, names, first_item, problems=engine.start_problems)
        pending = engine.pending
        if pending is None:
            return check
        if pending["window"] is not None:
            feed.fill()  # the whole window: its length is checked against the micro-batches done
        if engine.guard._scheduler_epoch() != pending["scheduler_epoch"]:
            check.problems |= SCHEDULER
        saved = pending.get("fingerprints")
        if saved is not None:
            now = fingerprints(engine)
            check.model_diff = _differ(names, saved["model"], now["model"])
            check.optimizer_diff = _differ(names, saved["optimizer"], now["optimizer"])
        progress = pending.get("optimizer")
        moved = progress is not None and [float(v) for v in progress] != _progress(engine)
        check.problems |= OPTIMIZER if moved or check.optimizer_diff else 0
        check.problems |= MODEL if check.model_diff else 0
        check.problems |= 0 if check_position(pending, first_item) else DATA
        return check

    def row(self) -> list[float]:
        engine, pending = self.engine, self.engine.pending
        window = pending["window"] if pending is not None else None
        return [
            float(pending is not None),
            float(engine.counters.steps),
            float(engine.counters.skipped_windows),
            float(window["micro_batches_done"]) if window is not None else 0.0,
            float(bool(window["final_backward"])) if window is not None else 0.0,
            float(self.problems),
        ]

    def verdict(self, rows: list[list[float]], have: list[int]) -> None:
        """Raise :class:`ResumeMismatch` on every rank when any rank's row shows a problem.

        ``rows``: every rank's :meth:`row`; ``have``: every rank's micro-batches in this
        window, padding included.
        """
        world = len(rows)
        found = [
            self._say(bit, ranks, world)
            for bit in (SCHEDULER, NO_STATE, OPTIMIZER, MODEL, DATA)
            if (ranks := [r for r, row in enumerate(rows) if int(row[_PROBLEMS]) & bit])
        ]
        if any(row[_LOADED] for row in rows):
            found.extend(
                self._disagreement(rows, have, data=any(int(r[_PROBLEMS]) & DATA for r in rows))
            )
        if found:
            raise ResumeMismatch(
                " ".join(found) + " Nothing was changed: fix this and call acc.windows() again."
            )

    # -- across ranks ---------------------------------------------------------------------------

    def _disagreement(self, rows: list[list[float]], have: list[int], data: bool) -> list[str]:
        windows = _by_value([f"acc.steps={int(r[_STEPS])}" + _skipped(r) for r in rows])
        if len(windows) > 1:
            return [
                f"The ranks loaded the states of different windows ({_show(windows)}): every rank "
                "must load its own state from the same checkpoint, saved at the same point of "
                "the loop (a rank that loaded an older state, or none, would wait for the "
                "others in a collective until the process group's timeout)."
            ]
        equal = self.engine.sync.equal_micro_batches
        inside = [r for r in rows if equal or not r[_FINAL]]
        if len({r[_DONE] for r in inside}) > 1:
            points = _by_value([f"{int(r[_DONE])} micro-batch(es) done" for r in rows])
            return [
                "The ranks loaded states from different points of the same window "
                f"({_show(points)}): "
                "every rank must load its own state from the same checkpoint, saved after the "
                "same micro-batch (a rank that runs more micro-batches than the others would "
                "wait for them in a collective)."
            ]
        short = [r for r, row in enumerate(rows) if have[r] < row[_DONE]]
        if not short or data:  # a loader at the wrong position says so already
            return []
        where = f" on rank(s) {short}" if len(rows) > 1 else ""
        done = int(rows[short[0]][_DONE])
        return [
            f"The resumed window has only {have[short[0]]} micro-batch(es){where} but the "
            f"state was taken after {done}: the loader does not start at "
            "state['loader_items'] or yields different items. Give acc.windows() the loader "
            "from that item on."
        ]

    # -- one rank's problems --------------------------------------------------------------------

    def _say(self, bit: int, ranks: list[int], world: int) -> str:
        engine = self.engine
        me = engine.sync.rank
        pending = engine.pending
        if bit == DATA:
            if pending is not None:
                return wrong_position(pending, self.first_item, ranks)
            return f"The loader does not start at state['loader_items'] on rank(s) {ranks}."
        prefix = f"On rank(s) {ranks}: " if world > 1 else ""
        if me not in ranks or (pending is None and bit != NO_STATE):
            return prefix + _GENERIC[bit]
        if bit == SCHEDULER:
            assert pending is not None
            return prefix + (
                f"the scheduler's last_epoch is {engine.guard._scheduler_epoch()} but was "
                f"{pending['scheduler_epoch']} when the state was saved: load the "
                "scheduler's state_dict too (scheduler.load_state_dict(...)) before "
                "acc.windows(loader)."
            )
        if bit == NO_STATE:
            return prefix + _not_loaded(engine)
        if bit == OPTIMIZER:
            return prefix + self._optimizer_detail()
        return prefix + (
            f"the model's parameters are not the ones saved with this state: "
            f"{_names(self.model_diff, len(self.names))} differ. The model's state was not "
            "loaded, or was loaded from another checkpoint (an older one?). Load the model's "
            "state saved at the same moment as this Accumulator state (model.load_state_dict"
            "(...); under FSDP2 dcp.load(...) then set_state_dict(model, optimizer, ...)) "
            "before acc.windows(loader)."
        )

    def _optimizer_detail(self) -> str:
        engine = self.engine
        pending = engine.pending
        assert pending is not None
        saved, now = pending.get("optimizer"), _progress(engine)
        fix = (
            "Load the optimizer's state saved at the same moment, before acc.windows(loader) "
            "(optimizer.load_state_dict(...); under FSDP2 dcp.load(...) then "
            "set_state_dict(model, optimizer, model_state_dict=..., optim_state_dict=...)): "
            "a fresh optimizer (no momentum, no Adam moments, step 0) trains differently "
            "from the uninterrupted run."
        )
        if saved is not None and [float(v) for v in saved] != now:
            return (
                f"the optimizer's state does not match the loaded Accumulator state (acc.steps "
                f"= {engine.counters.steps}): the optimizer holds state for {int(now[0])} "
                "parameter(s)"
                f"{_steps(now)}, the run that saved it held state for {int(saved[0])}"
                f"{_steps(saved)}. {fix}"
            )
        return (
            f"the optimizer's state is not the one saved with this state: the state of "
            f"{_names(self.optimizer_diff, len(self.names))} differs, though it holds state "
            f"for {int(now[0])} parameter(s){_steps(now)} as the saving run did. It was not "
            "loaded (DCP's get_state_dict(model, optimizer) gives a fresh optimizer a zeroed "
            "state at step 1), or was loaded from another checkpoint. " + fix
        )


_GENERIC = {
    SCHEDULER: "the scheduler's state does not match the loaded state: load the scheduler's "
    "state_dict too (scheduler.load_state_dict(...)).",
    NO_STATE: "the scheduler's state was loaded and the Accumulator's was not: "
    "acc.load_state_dict(state) too.",
    OPTIMIZER: "the optimizer's state is not the one saved with the loaded state: load it too "
    "(optimizer.load_state_dict(...), or set_state_dict(...) after dcp.load).",
    MODEL: "the model's parameters are not the ones saved with the loaded state: load them "
    "too (model.load_state_dict(...), or set_state_dict(...) after dcp.load).",
}


def _not_loaded(engine: Engine) -> str:
    guard = engine.guard
    return (
        f"the scheduler's last_epoch moved from {guard._epoch} to "
        f"{guard._scheduler_epoch()} after this Accumulator was built and before its first "
        "window, but no Accumulator state was loaded: the scheduler's state was loaded "
        "(scheduler.load_state_dict) and the Accumulator's was not. Load it too, before "
        "acc.windows(loader): acc.load_state_dict(state) with the state saved by "
        "acc.state_dict() next to the scheduler's; it holds the step count and the loader "
        "position (state['loader_items']). (If you stepped the scheduler yourself before "
        "training, build the Accumulator after that.)"
    )


def _progress(engine: Engine) -> list[float]:
    return optimizer_progress(engine.optimizer)


def _differ(names: list[str], saved: torch.Tensor, now: torch.Tensor) -> list[str]:
    """The names of the parameters whose sums differ (all of them when the counts differ)."""
    if tuple(saved.shape) != tuple(now.shape):
        return list(names)
    rows = (saved.to(now.dtype) != now).any(dim=1).tolist()
    return [name for name, bad in zip(names, rows, strict=True) if bad]


def _names(differ: list[str], total: int) -> str:
    shown = ", ".join(differ[:_SHOWN]) + (", ..." if len(differ) > _SHOWN else "")
    return f"{len(differ)} of {total} trained parameter(s) ({shown})"


def _steps(progress: Any) -> str:
    return f" at step {int(progress[1])}" if progress[1] >= 0 else ""


def _skipped(row: list[float]) -> str:
    return f", skipped_windows={int(row[_SKIPPED])}" if row[_SKIPPED] else ""


def _by_value(values: list[str]) -> dict[str, list[int]]:
    """Each value with the ranks that have it, in the order of first appearance."""
    ranks: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        ranks.setdefault(value, []).append(rank)
    return ranks


def _show(groups: dict[str, list[int]]) -> str:
    """``"a on rank(s) [0, 2], b on rank(s) [1]"``."""
    return ", ".join(f"{value} on rank(s) {ranks}" for value, ranks in groups.items())

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
  inside its window; and where the wrapper reduces inside the last backward, DDP's
  ``ddp_sync="last"``, every rank has finished its window or none has), and every rank's
  resumed window is long enough (its real micro-batches plus the padding the exchange gives it).

This rank's result is one row of the window-start exchange
(:func:`fullbatch._engine._start.start_window`), so a problem on one rank raises on every rank
(:class:`ResumeMismatch`), none left waiting in a collective, and with the same message on
every rank: it is written from the rows alone (:mod:`fullbatch._engine._resume_texts`).
``loader_items`` is not compared across ranks: a rank whose data ran out has consumed fewer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from fullbatch._engine._checkpoint import (
    AT_ITEM,
    fingerprints,
    optimizer_progress,
    param_names,
    position,
)
from fullbatch._engine._core import Engine
from fullbatch._engine._feed import Feed
from fullbatch._engine._resume_texts import (
    DATA,
    MODEL,
    NO_STATE,
    OPTIMIZER,
    SCHEDULER,
    SHOWN,
    WIDTH,
    refusal,
)

__all__ = ["NO_STATE", "WIDTH", "ResumeCheck", "ResumeMismatch"]

_NAN = float("nan")


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
    problems: int = 0
    model_diff: list[int] = field(default_factory=list)  # indices of parameters that differ
    optimizer_diff: list[int] = field(default_factory=list)
    position: int = AT_ITEM

    @classmethod
    def local(cls, engine: Engine, names: list[str], feed: Feed, first_item: Any) -> ResumeCheck:
        check = cls(engine, names, problems=engine.start_problems)
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
            check.model_diff = _differ(saved["model"], now["model"])
            check.optimizer_diff = _differ(saved["optimizer"], now["optimizer"])
        progress = pending.get("optimizer")
        moved = progress is not None and [float(v) for v in progress] != _progress(engine)
        check.problems |= OPTIMIZER if moved or check.optimizer_diff else 0
        check.problems |= MODEL if check.model_diff else 0
        check.position = position(pending, first_item)
        check.problems |= 0 if check.position == AT_ITEM else DATA
        return check

    def row(self) -> list[float]:
        """This rank's row: its flags and the numbers every rank's message shows."""
        engine, pending = self.engine, self.engine.pending
        window = pending["window"] if pending is not None else None
        guard = engine.guard
        if pending is not None:
            epochs = [guard._scheduler_epoch(), pending["scheduler_epoch"]]
            saved = pending.get("optimizer") or [_NAN, _NAN]
        else:
            epochs, saved = [guard._scheduler_epoch(), guard._epoch], [_NAN, _NAN]
        row = [
            float(pending is not None),
            float(engine.counters.steps),
            float(engine.counters.skipped_windows),
            float(window["micro_batches_done"]) if window is not None else 0.0,
            float(bool(window["final_backward"])) if window is not None else 0.0,
            float(self.problems),
            *[_NAN if e is None else float(e) for e in epochs],
            *(_progress(engine) if pending is not None else [_NAN, _NAN]),
            *[float(v) for v in saved],
            *_listed(self.optimizer_diff),
            *_listed(self.model_diff),
            float(pending["loader_items"]) if pending is not None else 0.0,
            float(self.position),
        ]
        assert len(row) == WIDTH  # the slots of _resume_texts
        return row

    def verdict(self, rows: list[list[float]], have: list[int]) -> None:
        """Raise :class:`ResumeMismatch` on every rank when any rank's row shows a problem,
        with the same message on every rank.

        ``rows``: every rank's :meth:`row`; ``have``: every rank's micro-batches in this
        window, padding included.
        """
        sync = self.engine.sync
        # The names on every rank, whether it loaded a state or not: the same message everywhere.
        names = self.names or param_names(self.engine)
        text = refusal(
            rows,
            have,
            names,
            equal=sync.equal_micro_batches,
            in_backward=sync.syncs_in_backward,
        )
        if text:
            raise ResumeMismatch(text)


def _progress(engine: Engine) -> list[float]:
    return optimizer_progress(engine.optimizer)


def _differ(saved: torch.Tensor, now: torch.Tensor) -> list[int]:
    """The indices of the parameters whose sums differ (all of them when the counts differ)."""
    if tuple(saved.shape) != tuple(now.shape):
        return list(range(now.shape[0]))
    return [i for i, bad in enumerate((saved.to(now.dtype) != now).any(dim=1).tolist()) if bad]


def _listed(indices: list[int]) -> list[float]:
    """``[how many, the first SHOWN of them (-1 for none)]``."""
    shown = [float(i) for i in indices[:SHOWN]]
    return [float(len(indices)), *shown, *[-1.0] * (SHOWN - len(shown))]

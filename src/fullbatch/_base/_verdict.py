"""The end of a window, decided once for every wing: step or skip, by how much, who is told.

Every wing that ends a window — the engine (``window.step()``) and the framework wings, whose
wing window (``fullbatch._wings._window``) closes here — hands the window's reduced numbers
(:class:`WindowTotals`: ``Σ loss_sum``, ``N``, the squared norm, ``W``, ``c``) to
:func:`decide` and acts on the :class:`Verdict`; it counts the outcome in one
:class:`WindowCounters`, which also warns about skips. The arithmetic is in
:mod:`fullbatch._base._normalize`; nothing here touches a tensor. What a wing provides and
may rely on: docs/wings.md ("Writing a new wing").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fullbatch._base._normalize import grad_factor, power_of_two_scale
from fullbatch._base._warn import warn

__all__ = [
    "NONFINITE_GRADIENT",
    "NONFINITE_LOSS",
    "NO_ITEMS",
    "CountedSteps",
    "Verdict",
    "WindowCounters",
    "WindowTotals",
    "decide",
]

NO_ITEMS = "no items counted in the window"
NONFINITE_LOSS = "non-finite loss"
NONFINITE_GRADIENT = "non-finite gradient"


@dataclass(frozen=True, slots=True)
class WindowTotals:
    """What a wing knows when its window ends, reduced over micro-batches and ranks.

    Attributes:
        loss: ``Σ loss_sum`` (count form, not multiplied by ``c``) or the sum of the shares.
        count: ``N``; ``None`` where the losses are shares with no count.
        squared_norm: sum of squares of the accumulated gradients, before any factor.
        divisor: ``W``, what the framework divided the summed gradient by.
        loss_scale: ``c``, what every count-form loss was multiplied by before backward.
        max_grad_norm: clip the normalized gradient to this norm (``None``: the wing does not
            clip, or its framework clips later).
        share: the losses were already divided by their totals (no ``1 / (c · N)`` at the step).
    """

    loss: float
    count: float | None
    squared_norm: float
    divisor: float = 1.0
    loss_scale: float = 1.0
    max_grad_norm: float | None = None
    share: bool = False

    @property
    def loss_finite(self) -> bool:
        return math.isfinite(self.loss)

    @property
    def grad_finite(self) -> bool:
        return math.isfinite(self.squared_norm)


@dataclass(frozen=True, slots=True)
class Verdict:
    """How a window ends (see the module docstring for what each number means).

    Attributes:
        reason: why the window is skipped, or ``None`` when it steps.
        factor: the gradient multiplier ``W / (c · N)`` (share form: ``W``).
        clip: the clip multiplier (1.0 without clipping or on a skip).
        grad_norm: the normalized gradient's norm before clipping (NaN when non-finite or
            ``N = 0``).
        loss: the window's loss to report.
        next_loss_scale: ``c`` for the next window, or ``None`` to keep the current one.
    """

    reason: str | None
    factor: float
    clip: float
    grad_norm: float
    loss: float
    next_loss_scale: float | None

    @property
    def skipped(self) -> bool:
        return self.reason is not None


def decide(totals: WindowTotals) -> Verdict:
    """The one skip rule and scale of every wing.

    >>> v = decide(WindowTotals(loss=6.0, count=4.0, squared_norm=0.25, divisor=2.0,
    ...     loss_scale=0.25, max_grad_norm=1.0))
    >>> v.reason, v.factor, v.grad_norm, round(v.clip, 6), v.loss, v.next_loss_scale
    (None, 2.0, 1.0, 0.999999, 1.5, 0.25)
    >>> decide(WindowTotals(loss=0.0, count=0.0, squared_norm=0.0)).reason
    'no items counted in the window'
    >>> decide(WindowTotals(loss=float("nan"), count=3.0, squared_norm=1.0)).reason
    'non-finite loss'
    >>> decide(WindowTotals(loss=1.0, count=3.0, squared_norm=float("inf"))).reason
    'non-finite gradient'
    """
    t = totals
    counted = t.count is not None
    factor = grad_factor(t.divisor, None if t.share else t.count, t.loss_scale)
    grad_norm = math.sqrt(t.squared_norm) * factor if t.grad_finite else math.nan
    reason = None
    if counted and t.count == 0:
        reason, grad_norm = NO_ITEMS, math.nan
    elif not t.loss_finite:
        reason = NONFINITE_LOSS
    elif not t.grad_finite:
        reason = NONFINITE_GRADIENT
    clip = 1.0
    if reason is None and t.max_grad_norm is not None:
        clip = min(1.0, t.max_grad_norm / (grad_norm + 1e-6))
    if t.share:
        loss = t.loss if not (counted and t.count == 0) else math.nan
    else:
        loss = t.loss / t.count if t.count else math.nan
    next_c = power_of_two_scale(t.count) if counted and not t.share and t.count else None
    return Verdict(reason, factor, clip, grad_norm, loss, next_c)


@dataclass
class WindowCounters:
    """A wing's counts of ended windows, and the one warning policy for skips.

    A plain dataclass (not slotted): ``fullbatch.hf.check_trainer`` copies and restores the
    dataclasses a Trainer holds, so a check leaves the counts as they were.

    ``steps`` counts optimizer steps taken; ``skipped_windows`` the windows skipped. A skip
    warns (``RuntimeWarning``, at the user's line) at the 1st, 2nd, 4th, 8th, ... skip, so a
    long run is not flooded; the text is the same from every wing.

    >>> import warnings
    >>> counters = WindowCounters()
    >>> counters.stepped()
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     for _ in range(3):
    ...         counters.skipped(counters.windows, NONFINITE_LOSS, report="stats.skipped_windows")
    >>> counters.steps, counters.skipped_windows, counters.windows, len(caught)
    (1, 3, 4, 2)
    >>> print(caught[1].message)  # doctest: +NORMALIZE_WHITESPACE
    window 2 was skipped (non-finite loss): parameters, optimizer and scheduler are unchanged.
    2 window(s) skipped so far, 1 stepped; every skip is counted in stats.skipped_windows
    (this warning repeats at 1, 2, 4, 8, ... skips).
    """

    steps: int = 0
    skipped_windows: int = 0

    @property
    def windows(self) -> int:
        """Windows ended so far, stepped or skipped."""
        return self.steps + self.skipped_windows

    def stepped(self) -> None:
        self.steps += 1

    def skipped(
        self,
        index: int,
        reason: str,
        *,
        report: str,
        scaler: bool = False,
        through: tuple[str, ...] = (),
    ) -> None:
        """Count a skipped window ``index`` and warn at the 1st, 2nd, 4th, 8th, ... skip.

        ``report``: where the user reads the counters (e.g. ``"stats.skipped_windows"``);
        ``scaler``: a GradScaler is on (a few non-finite gradients are expected while it
        calibrates); ``through``: the framework packages between the user's line and here.
        """
        self.skipped_windows += 1
        n = self.skipped_windows
        if n & (n - 1):
            return
        hint = (
            " With a GradScaler a few skips are expected while it calibrates its scale."
            if scaler and reason == NONFINITE_GRADIENT
            else ""
        )
        warn(
            f"window {index} was skipped ({reason}): parameters, optimizer and scheduler are "
            f"unchanged. {n} window(s) skipped so far, {self.steps} stepped; every skip is "
            f"counted in {report} (this warning repeats at 1, 2, 4, 8, ... skips).{hint}",
            RuntimeWarning,
            through=through,
        )


class CountedSteps:
    """The counters a wing shows its users, read from its ``counters``: mix it into a wing's
    public class (``fb.Pipeline``, Lightning's ``ExactAccumulation``) so every wing spells
    ``steps`` and ``skipped_windows`` the same way.

    >>> class Wing(CountedSteps):
    ...     def __init__(self) -> None:
    ...         self.counters = WindowCounters(steps=3, skipped_windows=1)
    >>> Wing().steps, Wing().skipped_windows
    (3, 1)
    """

    counters: WindowCounters

    @property
    def steps(self) -> int:
        """Optimizer steps taken (skipped windows are not steps)."""
        return self.counters.steps

    @property
    def skipped_windows(self) -> int:
        """Windows skipped: no counted items, a non-finite loss or gradient."""
        return self.counters.skipped_windows

"""The one verdict (``fullbatch._base._verdict``): the skip rule and its order, the numbers it
hands every wing, the warning policy, and warnings that walk past a framework's frames."""

from __future__ import annotations

import functools
import math
import warnings

import pytest

from fullbatch._base._normalize import grad_factor, power_of_two_scale
from fullbatch._base._verdict import (
    NO_ITEMS,
    NONFINITE_GRADIENT,
    NONFINITE_LOSS,
    WindowCounters,
    WindowTotals,
    decide,
)

NAN, INF = math.nan, math.inf


@pytest.mark.parametrize(
    ("loss", "count", "sq", "reason"),
    [
        (1.0, 0.0, 1.0, NO_ITEMS),
        (NAN, 0.0, INF, NO_ITEMS),  # zero items first, whatever else is wrong
        (NAN, 3.0, 1.0, NONFINITE_LOSS),
        (-INF, 3.0, INF, NONFINITE_LOSS),  # the loss before the gradient
        (1.0, 3.0, INF, NONFINITE_GRADIENT),
        (1.0, 3.0, NAN, NONFINITE_GRADIENT),
        (1.0, 3.0, 1.0, None),
    ],
)
def test_skip_rule_and_its_order(loss: float, count: float, sq: float, reason: str) -> None:
    verdict = decide(WindowTotals(loss=loss, count=count, squared_norm=sq))
    assert verdict.reason == reason and verdict.skipped == (reason is not None)
    if reason is not None:
        assert verdict.clip == 1.0  # nothing to clip: nothing steps


def test_count_form_numbers_come_from_normalize() -> None:
    t = WindowTotals(loss=7.0, count=10.0, squared_norm=0.04, divisor=2.0, loss_scale=1 / 16,
                     max_grad_norm=0.5)  # fmt: skip
    v = decide(t)
    assert v.factor == grad_factor(2.0, 10.0, 1 / 16)  # bitwise: one place computes it
    assert v.grad_norm == math.sqrt(0.04) * v.factor
    assert v.clip == min(1.0, 0.5 / (v.grad_norm + 1e-6)) and v.clip < 1.0
    assert v.loss == 0.7 and v.next_loss_scale == power_of_two_scale(10.0) == 1 / 16
    unclipped = decide(WindowTotals(loss=7.0, count=10.0, squared_norm=0.04))
    assert unclipped.clip == 1.0


def test_zero_items_report_nan_and_keep_c() -> None:
    v = decide(WindowTotals(loss=0.0, count=0.0, squared_norm=0.0, loss_scale=0.25))
    assert math.isnan(v.loss) and math.isnan(v.grad_norm) and v.next_loss_scale is None


def test_share_forms() -> None:
    # engine's backward(share): no count, the factor is W, the loss is the sum of shares
    v = decide(WindowTotals(loss=0.5, count=None, squared_norm=1.0, divisor=4.0, share=True))
    assert (v.reason, v.factor, v.loss, v.next_loss_scale) == (None, 4.0, 0.5, None)
    # GRPO: shares with a count, skipped when the objective has no item
    empty = decide(WindowTotals(loss=0.0, count=0.0, squared_norm=0.0, share=True))
    assert empty.reason == NO_ITEMS and math.isnan(empty.loss)
    kept = decide(WindowTotals(loss=0.5, count=12.0, squared_norm=1.0, share=True))
    assert (kept.reason, kept.factor, kept.loss, kept.next_loss_scale) == (None, 1.0, 0.5, None)


def test_counters_warn_at_powers_of_two_with_one_text() -> None:
    counters = WindowCounters()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(9):
            if i % 3 == 0:
                counters.stepped()
            counters.skipped(counters.windows, NONFINITE_GRADIENT, report="x.skipped_windows",
                             scaler=i == 0)  # fmt: skip
    assert (counters.steps, counters.skipped_windows, counters.windows) == (3, 9, 12)
    texts = [str(w.message) for w in caught]
    assert [t.split(" window(s)")[0].split(". ")[-1] for t in texts] == ["1", "2", "4", "8"]
    assert all(w.category is RuntimeWarning and w.filename == __file__ for w in caught)
    assert texts[0].startswith("window 1 was skipped (non-finite gradient): parameters,")
    assert texts[0].endswith(
        "With a GradScaler a few skips are expected while it calibrates its scale."
    )
    assert "every skip is counted in x.skipped_windows" in texts[1]
    assert "GradScaler" not in texts[1]


def test_warning_walks_past_the_frameworks_named() -> None:
    """A framework's loop calls a fullbatch hook that warns: with ``through=`` naming the
    framework the warning points here (the user's line), without it at the framework."""
    namespace = {"__name__": "someframework.loop"}
    exec(compile("def loop(hook):\n    hook()\n", "someframework/loop.py", "exec"), namespace)
    loop = namespace["loop"]
    found = []
    for through in ((), ("someframework",)):
        hook = functools.partial(WindowCounters().skipped, 0, NO_ITEMS, report="r",
                                 through=through)  # fmt: skip
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loop(hook)
        found.append(caught[0].filename)
    assert found == ["someframework/loop.py", __file__]

"""Warnings point at the user's line, whichever driver reaches them (a computed stack level).

A hard-coded ``stacklevel`` is right for one call path only; these check the warning's file and
line under the plain loop, ``window.run`` and ``window.run_coupled``.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import fullbatch as fb


def _caught(fn: Callable[[], Any], match: str) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    found = [w for w in caught if match in str(w.message)]
    assert found, [str(w.message) for w in caught]
    return found


def _line_of(marker: str) -> int:
    """The line of this file holding ``marker`` (a comment on the user's call)."""
    lines = inspect.getsource(inspect.getmodule(_line_of)).splitlines()  # type: ignore[arg-type]
    return next(i for i, line in enumerate(lines, 1) if line.rstrip().endswith(marker))


def _setup() -> tuple[nn.Module, fb.Accumulator, list[dict[str, torch.Tensor]]]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    acc = fb.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=2)
    nothing = {"x": torch.randn(4, 3), "y": torch.full((4,), -100)}  # no counted item: skipped
    return model, acc, [nothing]


def test_skipped_window_warning_under_the_plain_loop() -> None:
    model, acc, data = _setup()

    def loop() -> None:
        for window in acc.windows(data):
            for micro in window:
                window.backward(*fb.cross_entropy_sum(model(micro["x"]), micro["y"]))
            window.step()  # <- plain

    (w,) = _caught(loop, "was skipped")
    assert (w.filename, w.lineno) == (__file__, _line_of("# <- plain"))


def test_skipped_window_warning_under_window_run() -> None:
    model, acc, data = _setup()

    def run() -> None:
        for window in acc.windows(data):
            window.run(lambda m: fb.cross_entropy_sum(model(m["x"]), m["y"]))  # <- run

    (w,) = _caught(run, "was skipped")
    assert (w.filename, w.lineno) == (__file__, _line_of("# <- run"))


def test_skipped_window_warning_under_run_coupled() -> None:
    model, acc, data = _setup()

    def loss(reps: torch.Tensor, rows: slice) -> tuple[torch.Tensor, float]:
        return reps[rows].sum() * 0.0, 0.0  # no counted item

    def coupled() -> None:
        for window in acc.windows(data):
            window.run_coupled(lambda m: model(m["x"]), loss)  # <- coupled

    (w,) = _caught(coupled, "was skipped")
    assert (w.filename, w.lineno) == (__file__, _line_of("# <- coupled"))


def test_skipped_window_warning_under_auto_retry() -> None:
    """An "auto" retry (one more level of drivers) still points at the user's window.run."""
    model, _, data = _setup()
    calls = []

    def fn(m: dict[str, torch.Tensor]) -> Any:
        calls.append(len(m["x"]))
        if len(m["x"]) > 2:
            raise torch.OutOfMemoryError("too many rows")
        return fb.cross_entropy_sum(model(m["x"]), m["y"])

    def run() -> None:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with fb.Accumulator(model, opt, micro_batch_size="auto") as acc:
            for window in acc.windows(data):
                window.run(fn)  # <- auto

    (w,) = _caught(run, "was skipped")
    assert calls[:2] == [4, 2]  # it did retry
    assert (w.filename, w.lineno) == (__file__, _line_of("# <- auto"))


def test_batchnorm_warning_points_at_the_accumulator() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    (w,) = _caught(lambda: fb.Accumulator(model, opt, micro_batches=2), "BatchNorm")  # <- bn
    assert (w.filename, w.lineno) == (__file__, _line_of("# <- bn"))


def test_packing_warning_points_at_the_loop() -> None:
    model = nn.Embedding(10, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0]])
    item = {"input_ids": torch.ones(2, 6, dtype=torch.long), "attention_mask": mask}

    def loop() -> None:
        with fb.Accumulator(model, opt, micro_batch_tokens=4) as acc:
            for window in acc.windows([item]):  # <- pack
                window.discard()

    (w,) = _caught(loop, "longer than micro_batch_tokens")
    assert (w.filename, w.lineno) == (__file__, _line_of("# <- pack"))


def test_a_correct_loop_does_not_warn() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [{"x": torch.randn(4, 3), "y": torch.tensor([0, 1, 1, 0])}]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with fb.Accumulator(model, opt, micro_batch_size=2) as acc:
            for window in acc.windows(data):
                window.run(lambda m: fb.cross_entropy_sum(model(m["x"]), m["y"]))

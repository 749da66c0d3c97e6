"""Every text of the probe numbers windows as its report does (1 for the first ``step()`` seen
in the block): a failure of its own check ("not checked from window N on"), the line saying
where the run failed, and, where a fullbatch message (which counts windows from 0) ended the
run, that line says how the two count."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import fullbatch as fb
from fullbatch._probe._run import Probe

SIZES = (1, 3, 2, 5)


def _data(windows: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        {"x": torch.randn(n, 4, generator=g), "labels": torch.randint(3, (n,), generator=g)}
        for _ in range(windows)
        for n in SIZES
    ]


def _train(model: torch.nn.Module, data: list[dict[str, torch.Tensor]], crash_at: int = -1) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, batch in enumerate(data):
        if i == crash_at:
            raise KeyError("the script's own bug")
        loss = F.cross_entropy(model(batch["x"]), batch["labels"], reduction="sum")
        (loss / sum(SIZES)).backward()
        if (i + 1) % len(SIZES) == 0:
            opt.step()
            opt.zero_grad()


def test_a_crash_while_window_2_is_recorded_is_said_in_window_2() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    with pytest.raises(KeyError), fb.probe(objective="sample", windows=3) as probe:
        _train(model, _data(3), crash_at=len(SIZES) + 2)  # window 2's third micro-batch
    report = probe.report
    assert [w.step for w in report.windows] == [1] and report.windows[0].ok
    assert report.failure.endswith("(in window 2)"), report.failure


def test_the_probes_own_failure_names_the_first_window_it_leaves_out() -> None:
    calls = {"n": 0}

    def objective(model: torch.nn.Module, micro: dict[str, Any]) -> Any:
        calls["n"] += 1  # window 1: 4 micro-batches and the band's run
        if calls["n"] > len(SIZES) + 1:
            raise RuntimeError("the objective's own bug")
        return fb.cross_entropy_sum(model(micro["x"]), micro["labels"])

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    probe = Probe(None, None, objective=objective, windows="all", ranks=None, keep_going=True)
    with probe:
        _train(model, _data(3))
    report = probe.report
    assert [w.step for w in report.windows] == [1]
    assert len(report.problems) == 1 and report.problems[0].startswith(
        "not checked from window 2 on: the probe failed (ObjectiveFailed"
    ), report.problems


def test_a_fullbatch_message_counting_from_0_is_told_apart() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="step\\(\\) on window 0"):
        with fb.probe(objective="sample") as probe:
            with fb.Accumulator(model, opt, micro_batches=4) as acc:
                for window in acc.windows(_data(1)):
                    for micro in window:
                        window.backward(*fb.cross_entropy_sum(model(micro["x"]), micro["labels"]))
                    window.step()
                    window.step()  # a mistake fullbatch refuses, naming its window 0
    report = probe.report
    assert [w.step for w in report.windows] == [1] and report.windows[0].ok
    assert report.failure.endswith(
        "(after window 1's step; this report counts windows from 1, fullbatch's own messages "
        "from 0)"
    ), report.failure
    assert "failed: the run raised RuntimeError: step() on window 0" in str(report)

"""``fb.probe`` on hand-written loops in one process: a right loop passes, each known mistake is
flagged with its name, its weights and the error the test measures itself against the plain
full-batch reference (``tests/_probe_cases.py``)."""

from __future__ import annotations

import math

import pytest
import torch

import fullbatch as fb
from _probe_cases import (
    accumulate,
    applied,
    counted,
    full_batch_grad,
    make_net,
    micro_batches,
    objective,
    rel_error,
)

SIZES = (1, 4, 2, 5)  # uneven: a mean of means is wrong here


def _probe_one(how: str, *, sizes=SIZES, dropout: float = 0.0, **kwargs):
    """One window under the probe; the probe's report, the applied and the reference grads."""
    model = make_net(dropout=dropout)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    window = micro_batches(sizes)
    ref = full_batch_grad(model.eval() if dropout == 0 else model, window)
    model.train()
    with fb.probe(objective=objective, **kwargs) as probe:
        accumulate(model, window, how)
        got = applied(model)
        opt.step()
    return probe.report, got, ref, window


def test_a_right_loop_passes_and_its_error_is_the_references() -> None:
    report, got, ref, window = _probe_one("global")
    assert report.ok, str(report)
    (check,) = report.windows
    assert check.pattern == "right" and check.ok
    assert check.micro_batches == 4 and check.count == sum(counted(m) for m in window)
    assert check.error < 1e-13 and rel_error(got, ref) < 1e-13
    assert check.tolerance < 1e-13  # float64: 16 ulps, not a dtype's fixed tolerance
    assert all(abs(w - 1) < 1e-9 for w in check.weights)
    assert check.leftover == 0.0


def test_mean_of_per_micro_batch_means() -> None:
    report, got, ref, window = _probe_one("mean/K")
    (check,) = report.windows
    assert not report.ok and check.pattern == "mean of per-micro-batch means"
    assert check.error == pytest.approx(rel_error(got, ref), rel=1e-9)
    n = [counted(m) for m in window]
    expected = [sum(n) / (len(n) * k) for k in n]  # weight of a mean divided by K, over 1/N
    assert check.weights == pytest.approx(expected, rel=1e-6)
    assert n[0] == 1 and max(expected) == expected[0]
    assert f"micro-batch 1 (1 item) weighted {expected[0]:.2f}" in check.diagnosis
    assert "fb.Accumulator" in check.diagnosis


def test_mean_of_means_not_divided_by_k() -> None:
    report, got, ref, window = _probe_one("mean")
    (check,) = report.windows
    assert check.pattern == "mean of per-micro-batch means"
    assert "x4 (= K" in check.diagnosis
    n = [counted(m) for m in window]
    assert check.weights == pytest.approx([sum(n) / k for k in n], rel=1e-6)
    assert check.error == pytest.approx(rel_error(got, ref), rel=1e-9)


@pytest.mark.parametrize(
    ("how", "factor", "words"), [("global*K", 4.0, "= K"), ("global/K", 0.25, "= 1/K")]
)
def test_not_normalized(how: str, factor: float, words: str) -> None:
    report, got, ref, _ = _probe_one(how)
    (check,) = report.windows
    assert check.pattern == "not normalized" and words in check.diagnosis
    assert check.weights == pytest.approx([factor] * 4, rel=1e-6)
    assert check.error == pytest.approx(abs(factor - 1), rel=1e-6)
    assert rel_error(got, ref) == pytest.approx(abs(factor - 1), rel=1e-6)


def test_dropped_names_the_micro_batch() -> None:
    report, got, ref, _ = _probe_one("drop 2")
    (check,) = report.windows
    assert check.pattern == "dropped"
    assert "micro-batch 3 ran but contributed nothing" in check.diagnosis
    assert check.weights[2] == pytest.approx(0.0, abs=1e-6)
    assert [check.weights[i] for i in (0, 1, 3)] == pytest.approx([1.0] * 3, rel=1e-6)
    assert check.error == pytest.approx(rel_error(got, ref), rel=1e-9)


def test_counted_twice_names_the_micro_batch() -> None:
    report, got, ref, _ = _probe_one("twice 1")
    (check,) = report.windows
    assert check.pattern == "counted twice" and "micro-batch 2 weighted 2.00" in check.diagnosis
    assert check.weights[1] == pytest.approx(2.0, rel=1e-6)
    assert check.error == pytest.approx(rel_error(got, ref), rel=1e-9)


def test_leftover_gradient_from_before_the_window() -> None:
    model = make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    old, window = micro_batches([3], seed=7), micro_batches(SIZES)
    accumulate(model, old, "global")  # a backward before the loop, never cleared
    leftover = applied(model)
    ref = full_batch_grad(model, window)
    with fb.probe(objective=objective) as probe:
        accumulate(model, window, "global")
        got = applied(model)
        opt.step()
    (check,) = probe.report.windows
    assert check.pattern == "leftover gradient" and "zero_grad" in check.diagnosis
    assert check.leftover == pytest.approx(1.0, rel=1e-6)
    assert check.weights == pytest.approx([1.0] * 4, rel=1e-6)
    expected = [
        r + x for r, x in zip(ref, leftover, strict=True)
    ]  # the reference plus the old gradient
    assert rel_error(got, expected) < 1e-12
    assert check.error == pytest.approx(rel_error(got, ref), rel=1e-9)


def test_zero_grad_between_forward_and_backward_is_no_leftover() -> None:
    """Gradients present at the window's first forward but cleared before its backward."""
    model = make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    accumulate(model, micro_batches([3], seed=7), "global")
    window = micro_batches(SIZES)
    total = sum(counted(m) for m in window)
    with fb.probe(objective=objective) as probe:
        for i, micro in enumerate(window):
            loss_sum, _ = fb.cross_entropy_sum(model(micro), micro["labels"])
            if i == 0:
                opt.zero_grad(set_to_none=True)
            (loss_sum / total).backward()
        opt.step()
    assert probe.report.ok, str(probe.report)
    assert abs(probe.report.windows[0].leftover) < 1e-9


def test_dropout_is_replayed_not_mistaken_for_an_error() -> None:
    """With dropout p=0.5 the probe's recompute draws the same masks as the loop did."""
    report, _got, _ref, _ = _probe_one("global", dropout=0.5)
    assert report.ok, str(report)
    assert report.windows[0].error < 1e-13
    report, _, _, window = _probe_one("mean/K", dropout=0.5)
    assert report.windows[0].pattern == "mean of per-micro-batch means"
    n = [counted(m) for m in window]
    assert report.windows[0].weights == pytest.approx([sum(n) / (4 * k) for k in n], rel=1e-6)


def test_partial_window_and_off_by_one_boundary() -> None:
    """``batch_idx % K == 0`` steps after the first micro-batch: that window holds 1 of K and
    is weighted 1/K; the loop's tail window (2 of 4) is weighted 2/4."""
    model = make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = micro_batches([3] * 7)  # equal sizes: only the window's length is wrong
    with fb.probe(objective=objective, windows=3) as probe:
        for batch_idx, micro in enumerate(data):
            loss = torch.nn.functional.cross_entropy(
                model(micro), micro["labels"], ignore_index=-100
            )
            (loss / 4).backward()
            if batch_idx % 4 == 0 or batch_idx == len(data) - 1:
                opt.step()
                opt.zero_grad(set_to_none=True)
    first, _full, tail = probe.report.windows
    assert [w.micro_batches for w in probe.report.windows] == [1, 4, 2]
    assert (
        first.pattern == "partial window"
        and "1 micro-batches where others had 4" in first.diagnosis
    )
    assert first.weights == pytest.approx([0.25], rel=1e-6)
    assert tail.pattern == "partial window" and tail.weights == pytest.approx([0.5, 0.5], rel=1e-2)
    assert not probe.report.ok


def test_clip_grad_norm_is_compared_before_the_clip() -> None:
    applies = torch.nn.utils.clip_grad._clip_grads_with_norm_
    model = make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    window = micro_batches(SIZES)
    with fb.probe(objective=objective) as probe:
        accumulate(model, window, "global")
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        opt.step()
    (check,) = probe.report.windows
    assert probe.report.ok, str(probe.report)
    assert check.clip == (1e-3, pytest.approx(float(norm)))
    assert "compared before the clip" in str(probe.report)
    assert torch.nn.utils.clip_grad._clip_grads_with_norm_ is applies  # restored


def test_report_text_names_verdict_window_and_fix() -> None:
    report, *_ = _probe_one("mean/K")
    text = str(report)
    assert text.startswith("fullbatch probe: WRONG (1 of 1 windows wrong, a hand-written loop)")
    assert "window 1: WRONG -- 4 micro-batches" in text and "weights: 2.25 0.75" in text
    assert not math.isnan(report.windows[0].band)


class _Regressor(torch.nn.Module):
    """A head called as Hugging Face heads are: ``model(x=..., labels=...)`` -> logits."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(6, 1).double()

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return self.lin(x)


def test_sample_objective_on_a_regression_target() -> None:
    """``objective="sample"`` with float labels: squared error summed over rows."""
    model = _Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    window = [
        {"x": torch.randn(n, 6, generator=g, dtype=torch.float64),
         "labels": torch.randn(n, generator=g, dtype=torch.float64)}
        for n in (1, 4, 3)
    ]  # fmt: skip
    with fb.probe(objective="sample", windows=2) as probe:
        for how in ("global", "mean/K"):
            for micro in window:
                err = (model(**micro).squeeze(-1) - micro["labels"]).pow(2)
                (err.sum() / 8 if how == "global" else err.mean() / 3).backward()
            opt.step()
            opt.zero_grad()
    right, wrong = probe.report.windows
    assert right.ok and right.objective == "sample" and right.count == 8
    assert wrong.pattern == "mean of per-micro-batch means"
    assert wrong.weights == pytest.approx([8 / 3, 8 / 12, 8 / 9], rel=1e-6)


def test_bfloat16_autocast_is_replayed_and_judged_by_its_band() -> None:
    """Forwards under ``torch.autocast(bfloat16)`` are replayed under it; the tolerance is the
    measured band (bfloat16 rounding), not float32's; a micro-batch named ``b`` (no usual name)
    is found by the identity of the tensor the model received."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [{"x": torch.randn(n, 16), "y": torch.randint(5, (n,))} for n in (3, 8, 5, 2)]

    def objective(m, micro):
        return fb.cross_entropy_sum(m(micro["x"]), micro["y"])

    with fb.probe(objective=objective, windows=2) as probe:
        for how in ("global", "mean/K"):
            for b in data:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    logits = model(b["x"])
                if how == "global":
                    (fb.cross_entropy_sum(logits, b["y"])[0] / 18).backward()
                else:
                    (torch.nn.functional.cross_entropy(logits.float(), b["y"]) / 4).backward()
            opt.step()
            opt.zero_grad()
    right, wrong = probe.report.windows
    assert right.ok, str(probe.report)
    assert 1e-4 < right.band < 0.1 and right.error > 1e-5  # bfloat16's rounding, measured
    assert not wrong.ok and wrong.pattern == "mean of per-micro-batch means"


@pytest.mark.parametrize("max_grad_norm", [None, 1e-3])
def test_accumulator_clipping_by_its_own_multiply_is_seen(max_grad_norm: float | None) -> None:
    """``fb.Accumulator(max_grad_norm=...)`` clips inside its one multiply, not through
    ``clip_grad_norm_``: the probe reads the clip from the step's verdict and passes; the
    applied gradient is the full batch's times that clip (measured here by hand)."""
    model = make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    window = micro_batches(SIZES)
    ref = full_batch_grad(model, window)
    norm = math.sqrt(sum(float(r.pow(2).sum()) for r in ref))
    seen: list[list[torch.Tensor]] = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append(applied(model)) and None)
    with fb.probe(objective=objective) as probe:
        acc = fb.Accumulator(model, opt, micro_batches=len(SIZES), max_grad_norm=max_grad_norm)
        for w in acc.windows(window):
            for micro in w:
                w.backward(*objective(model, micro))
            stats = w.step()
    assert probe.report.ok, str(probe.report)
    clip = 1.0 if max_grad_norm is None else max_grad_norm / (norm + 1e-6)
    assert stats.grad_norm == pytest.approx(norm, rel=1e-12)
    assert rel_error(seen[0], [r * clip for r in ref]) < 1e-12
    (check,) = probe.report.windows
    assert check.engine == "fb.Accumulator" and check.error < 1e-12

"""Every misuse raises its documented error, naming the fix, and changes nothing; skipped
windows leave parameters, optimizer and scheduler untouched and the next window is normal.

Each test starts from a model that has already taken one AdamW step (so the optimizer has a
``step`` count and moments to protect) and compares a full snapshot afterwards.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import pytest
import torch

import fullbatch as fb
from conftest import (
    IGNORE,
    Snapshot,
    class_batch,
    make_mlp,
    params,
    ref_mean_loss,
    rel_err,
    run_fullbatch,
)


@dataclass
class Setup:
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    batch: dict

    def snapshot(self) -> Snapshot:
        return Snapshot.take(self.model, self.opt, self.sched)

    def assert_unchanged(self, snap: Snapshot) -> None:
        snap.assert_same(self.model, self.opt, self.sched)

    def acc(self, **kwargs) -> fb.Accumulator:
        kwargs.setdefault("scheduler", self.sched)
        if "micro_batches" not in kwargs:
            kwargs.setdefault("micro_batch_size", 2)
        return fb.Accumulator(self.model, self.opt, **kwargs)

    def loss(self, micro):
        return fb.cross_entropy_sum(self.model(micro["x"]), micro["y"])


def make_opt(model):
    return torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.01)


def make_sched(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)


@pytest.fixture
def s() -> Setup:
    model = make_mlp()
    opt = make_opt(model)
    sched = make_sched(opt)
    batch = class_batch(5, seed=1, ignore=(2,))
    run_fullbatch(model, opt, [batch], micro_batch_size=2, scheduler=sched)
    assert int(opt.state[next(iter(model.parameters()))]["step"]) == 1
    return Setup(model, opt, sched, batch)


# -- constructor arguments -------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"micro_batches": 2, "micro_batch_size": 2}, {"micro_batches": None}],
)
def test_exactly_one_of_micro_batches_and_micro_batch_size(s: Setup, kwargs) -> None:
    snap = s.snapshot()
    with pytest.raises(ValueError, match=r"exactly one of micro_batches=K .*micro_batch_size=M"):
        fb.Accumulator(s.model, s.opt, **kwargs)
    s.assert_unchanged(snap)


@pytest.mark.parametrize("value", [0, -1, 2.5, "4", True, 2.0])
@pytest.mark.parametrize("name", ["micro_batches", "micro_batch_size"])
def test_bad_micro_batch_numbers(s: Setup, name: str, value) -> None:
    with pytest.raises(ValueError, match=rf"{name} must be an integer >= 1, got {value!r}"):
        fb.Accumulator(s.model, s.opt, **{name: value})


def test_auto_micro_batch_size_in_a_for_loop_names_window_run(s: Setup) -> None:
    snap = s.snapshot()
    with fb.Accumulator(s.model, s.opt, micro_batch_size="auto") as acc:
        for window in acc.windows([s.batch]):
            with pytest.raises(RuntimeError, match=r"window\.run\(fn\)|window\.run\("):
                for _ in window:
                    pass
            window.discard()
    s.assert_unchanged(snap)


def test_drop_needs_micro_batches(s: Setup) -> None:
    with pytest.raises(ValueError, match=r"micro_batches=K.*drop_last=True"):
        fb.Accumulator(s.model, s.opt, micro_batch_size=2, partial_window="drop")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"partial_window": "last"}, "partial_window must be 'step' or 'drop'"),
        ({"max_grad_norm": 0.0}, "max_grad_norm must be a finite number > 0"),
        ({"max_grad_norm": -1.0}, "max_grad_norm must be a finite number > 0"),
        ({"max_grad_norm": math.inf}, "max_grad_norm must be a finite number > 0"),
        ({"max_grad_norm": math.nan}, "max_grad_norm must be a finite number > 0"),
        ({"batchnorm": "micro"}, "batchnorm must be None or 'window'"),
        ({"counts": {"n": 3}}, "counts must map names to functions"),
    ],
)
def test_other_bad_arguments(s: Setup, kwargs, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fb.Accumulator(s.model, s.opt, micro_batch_size=2, **kwargs)


def test_options_are_keyword_only(s: Setup) -> None:
    with pytest.raises(TypeError):
        fb.Accumulator(s.model, s.opt, 2)  # type: ignore[misc]


# -- counts and losses given to backward ------------------------------------------------------

BAD_COUNTS = [
    -1,
    -0.5,
    math.nan,
    math.inf,
    -math.inf,
    torch.tensor(-1.0),
    torch.tensor(-3),
    torch.tensor(math.nan),
    torch.tensor(math.inf, dtype=torch.float64),
]


@pytest.mark.parametrize("count", BAD_COUNTS, ids=repr)
def test_bad_counts_raise_and_change_nothing(s: Setup, count) -> None:
    snap = s.snapshot()
    with s.acc() as acc:
        for window in acc.windows([s.batch]):
            micro = next(iter(window))
            loss_sum, _ = s.loss(micro)
            with pytest.raises(ValueError, match=r"finite and >= 0.*causal_lm_loss"):
                window.backward(loss_sum, count)
            window.discard()
    s.assert_unchanged(snap)


@pytest.mark.parametrize(
    "count", [True, "3", [2], torch.tensor([1, 2]), torch.tensor(2 + 0j)], ids=repr
)
def test_counts_that_are_not_numbers(s: Setup, count) -> None:
    snap = s.snapshot()
    with s.acc() as acc:
        for window in acc.windows([s.batch]):
            micro = next(iter(window))
            loss_sum, _ = s.loss(micro)
            with pytest.raises(ValueError, match=r"count.*causal_lm_loss"):
                window.backward(loss_sum, count)
            window.discard()
    s.assert_unchanged(snap)


def test_loss_must_be_a_scalar_that_requires_grad(s: Setup) -> None:
    snap = s.snapshot()
    with s.acc() as acc:
        for window in acc.windows([s.batch]):
            micro = next(iter(window))
            logits = s.model(micro["x"])
            with pytest.raises(ValueError, match="sum it first"):
                window.backward(logits.sum(dim=1), 2)
            with pytest.raises(ValueError, match="does not require grad"):
                window.backward(logits.detach().sum(), 2)
            window.discard()
    s.assert_unchanged(snap)


def test_countless_backward_needs_counts(s: Setup) -> None:
    snap = s.snapshot()
    with s.acc() as acc:
        for window in acc.windows([s.batch]):
            micro = next(iter(window))
            loss_sum, n = s.loss(micro)
            with pytest.raises(ValueError, match=r"counts= on the Accumulator.*window\.backward"):
                window.backward(loss_sum / n)
            with pytest.raises(RuntimeError, match="counts="):
                _ = window.totals
            window.discard()
    s.assert_unchanged(snap)


@pytest.mark.parametrize("first", ["share", "count"])
def test_mixing_forms_in_a_window(s: Setup, first: str) -> None:
    snap = s.snapshot()
    with s.acc(counts={"items": lambda m: int((m["y"] != IGNORE).sum())}) as acc:
        for window in acc.windows([s.batch]):
            total = window.totals["items"]
            it = iter(window)
            loss_sum, n = s.loss(next(it))
            if first == "share":
                window.backward(loss_sum / total)
            else:
                window.backward(loss_sum, n)
            loss_sum, n = s.loss(next(it))
            with pytest.raises(ValueError, match="one form per window"):
                if first == "share":
                    window.backward(loss_sum, n)
                else:
                    window.backward(loss_sum / total)
            window.discard()
    s.assert_unchanged(snap)


# -- order -----------------------------------------------------------------------------------


def test_gradients_present_when_a_window_starts(s: Setup) -> None:
    s.opt.zero_grad(set_to_none=True)
    ref_mean_loss(s.model, s.batch).backward()
    grads = [p.grad.clone() for p in s.model.parameters()]
    snap = s.snapshot()
    with s.acc() as acc, pytest.raises(RuntimeError) as info:
        next(iter(acc.windows([s.batch])))
    message = str(info.value)
    assert "optimizer.zero_grad(set_to_none=True)" in message
    assert "window.discard()" in message
    s.assert_unchanged(snap)
    # the user's gradients are not silently thrown away either
    assert all(torch.equal(p.grad, g) for p, g in zip(s.model.parameters(), grads, strict=True))


def test_backward_before_iterating(s: Setup) -> None:
    snap = s.snapshot()
    with s.acc() as acc:
        window = next(iter(acc.windows([s.batch])))
        loss_sum, n = s.loss(s.batch)
        with pytest.raises(RuntimeError, match=r"before iterating.*for micro in window"):
            window.backward(loss_sum, n)
        window.discard()
    s.assert_unchanged(snap)


def test_backward_after_the_window_is_exhausted(s: Setup) -> None:
    snap = s.snapshot()
    with s.acc() as acc:
        for window in acc.windows([s.batch]):
            for micro in window:
                window.backward(*s.loss(micro))
            loss_sum, n = s.loss(s.batch)
            with pytest.raises(RuntimeError, match=r"exhausted.*for micro in window"):
                window.backward(loss_sum, n)
            window.discard()
    s.assert_unchanged(snap)


def test_backward_after_step(s: Setup) -> None:
    with s.acc() as acc:
        for window in acc.windows([s.batch]):
            for micro in window:
                window.backward(*s.loss(micro))
            window.step()
            snap = s.snapshot()
            with pytest.raises(RuntimeError, match=r"already stepped or discarded.*next window"):
                window.backward(*s.loss(s.batch))
            s.assert_unchanged(snap)
            assert all(p.grad is None for p in s.model.parameters())


def test_backward_after_discard(s: Setup) -> None:
    snap = s.snapshot()
    with s.acc() as acc:
        for window in acc.windows([s.batch]):
            it = iter(window)
            window.backward(*s.loss(next(it)))
            window.discard()
            assert all(p.grad is None for p in s.model.parameters())
            with pytest.raises(RuntimeError, match="already stepped or discarded"):
                window.backward(*s.loss(s.batch))
            with pytest.raises(RuntimeError, match="already stepped or discarded"):
                next(it)
            with pytest.raises(RuntimeError, match="already stepped or discarded"):
                window.step()
    s.assert_unchanged(snap)


@pytest.mark.parametrize("kind", ["micro_batch_size", "micro_batches"])
def test_step_after_an_early_break(s: Setup, kind: str) -> None:
    snap = s.snapshot()
    kwargs = {"micro_batch_size": 2} if kind == "micro_batch_size" else {"micro_batches": 3}
    loader = [s.batch] if kind == "micro_batch_size" else [s.batch] * 3
    with s.acc(**kwargs) as acc:
        for window in acc.windows(loader):
            for micro in window:
                window.backward(*s.loss(micro))
                break
            with pytest.raises(RuntimeError, match=r"1 of 3.*early `break`.*window\.discard\(\)"):
                window.step()
            window.discard()
    s.assert_unchanged(snap)


def test_step_with_no_backward(s: Setup) -> None:
    snap = s.snapshot()
    with s.acc() as acc:
        for window in acc.windows([s.batch]):
            for _ in window:
                pass
            with pytest.raises(RuntimeError, match=r"no backward.*window\.backward"):
                window.step()
            window.discard()
    s.assert_unchanged(snap)


def test_step_without_backward_on_the_final_micro_batch(s: Setup) -> None:
    snap = s.snapshot()
    with s.acc() as acc:
        for window in acc.windows([s.batch]):
            micros = list(window)
            assert len(micros) == 3
            # backward for the first micro-batch only happens after the loop here: refused
            with pytest.raises(RuntimeError, match="exhausted"):
                window.backward(*s.loss(micros[0]))
            window.discard()
    s.assert_unchanged(snap)

    with s.acc() as acc:
        for window in acc.windows([s.batch]):
            for i, micro in enumerate(window):
                if i < 2:
                    window.backward(*s.loss(micro))
            with pytest.raises(RuntimeError, match="count=0"):
                window.step()
            window.discard()
    s.assert_unchanged(snap)


def test_step_twice(s: Setup) -> None:
    with s.acc() as acc:
        for window in acc.windows([s.batch]):
            for micro in window:
                window.backward(*s.loss(micro))
            stats = window.step()
            snap = s.snapshot()
            with pytest.raises(RuntimeError, match="already stepped"):
                window.step()
            s.assert_unchanged(snap)
    assert stats.steps == 1


def test_iterating_a_window_twice(s: Setup) -> None:
    snap = s.snapshot()
    with s.acc() as acc:
        for window in acc.windows([s.batch]):
            for micro in window:
                window.backward(*s.loss(micro))
            with pytest.raises(RuntimeError, match=r"iterated a second time.*in a list"):
                iter(window)
            window.discard()
    s.assert_unchanged(snap)


def test_window_neither_stepped_nor_discarded(s: Setup) -> None:
    snap = s.snapshot()
    windows = []
    with s.acc() as acc, pytest.raises(RuntimeError, match=r"window 0 .*window\.step\(\)"):
        for window in acc.windows([s.batch, s.batch]):
            windows.append(window)
            for micro in window:
                window.backward(*s.loss(micro))
    assert len(windows) == 1
    s.assert_unchanged(snap)


def test_closed_accumulator(s: Setup) -> None:
    acc = s.acc()
    acc.close()
    acc.close()  # safe twice
    with pytest.raises(RuntimeError, match="closed"):
        next(iter(acc.windows([s.batch])))


# -- loader items that cannot be split ---------------------------------------------------------


@pytest.mark.parametrize(
    "item,match",
    [
        ({"x": torch.randn(5, 6), "y": torch.zeros(4, dtype=torch.long)}, r"\['y'\].*shape \(4,\)"),
        ({"x": torch.randn(5, 6), "m": {"w": torch.randn(3, 2)}}, r"\['m'\]\['w'\]"),
        ((torch.randn(5, 6), torch.zeros(3)), r"batch\[1\]"),
        ({"a": 1, "b": "text", "c": torch.tensor(2.0)}, "no tensor with a first dimension"),
        ([1, 2, 3], "no tensor"),
        ({"x": torch.randn(0, 6), "y": torch.zeros(0)}, "0 rows"),
    ],
)
def test_loader_item_that_cannot_be_split(s: Setup, item, match: str) -> None:
    snap = s.snapshot()
    with s.acc() as acc, pytest.raises(ValueError, match=match):
        next(iter(acc.windows([item])))
    s.assert_unchanged(snap)


# -- skipped windows ---------------------------------------------------------------------------


def windows_for_skip_tests() -> list[dict]:
    return [class_batch(6, seed=10 + i, ignore=(i,)) for i in range(4)]


def reference_skipping(model, windows, skip: set[int]):
    """Plain full-batch AdamW + LambdaLR loop that simply leaves out the skipped windows."""
    ref = copy.deepcopy(model)
    opt = make_opt(ref)
    sched = make_sched(opt)
    out = []
    for i, batch in enumerate(windows):
        if i not in skip:
            opt.zero_grad(set_to_none=True)
            ref_mean_loss(ref, batch).backward()
            opt.step()
            sched.step()
        out.append(params(ref))
    return out, opt


def run_with_sabotage(model, windows, sabotage, **kwargs):
    """fullbatch loop where ``sabotage(i, loss_sum, n)`` may alter window i's loss."""
    opt = make_opt(model)
    sched = make_sched(opt)
    stats, snaps, states = [], [], []
    with fb.Accumulator(model, opt, micro_batch_size=4, scheduler=sched, **kwargs) as acc:
        for i, window in enumerate(acc.windows(windows)):
            for micro in window:
                loss_sum, n = fb.cross_entropy_sum(model(micro["x"]), micro["y"])
                window.backward(*sabotage(i, loss_sum, n))
            stats.append(window.step())
            snaps.append(params(model))
            states.append(Snapshot.take(model, opt, sched))
            assert all(p.grad is None for p in model.parameters())
    return stats, snaps, states, opt, sched


def check_skip(stats, snaps, states, opt, sched, model, ref, skipped: int, reason: str):
    assert [s.skipped for s in stats] == [i == skipped for i in range(len(stats))]
    bad = stats[skipped]
    assert bad.reason is not None and reason in bad.reason
    assert [s.steps for s in stats] == [i + (i < skipped) for i in range(len(stats))]
    # parameters, AdamW state (step, moments) and scheduler untouched by the skipped window
    states[skipped].assert_equal(states[skipped - 1])
    # the lr sequence: the scheduler stepped once per optimizer step, not on the skip
    lrs = [s.lr for s in stats]
    want = [0.1 * 0.5 ** (s.steps - 1) for s in stats]
    want[skipped] = 0.1 * 0.5 ** (stats[skipped].steps)
    assert lrs == pytest.approx(want, rel=1e-15)
    # the following windows match the full-batch loop that leaves the window out
    for got, expected in zip(snaps, ref, strict=True):
        assert rel_err(got, expected) < 1e-10
    for s in stats[skipped + 1 :]:
        assert not s.skipped and math.isfinite(s.loss) and math.isfinite(s.grad_norm)


def test_skip_window_with_zero_counted_items() -> None:
    windows = windows_for_skip_tests()
    windows[2]["y"][:] = IGNORE
    model = make_mlp()
    ref, _ = reference_skipping(model, windows, {2})
    out = run_with_sabotage(model, windows, lambda i, loss, n: (loss, n))
    stats = out[0]
    check_skip(*out, model, ref, skipped=2, reason="no items")
    assert math.isnan(stats[2].loss) and stats[2].count == 0


@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_skip_window_with_non_finite_loss(value: float) -> None:
    windows = windows_for_skip_tests()
    model = make_mlp()
    ref, _ = reference_skipping(model, windows, {1})
    out = run_with_sabotage(
        model, windows, lambda i, loss, n: (loss * value if i == 1 else loss, n)
    )
    check_skip(*out, model, ref, skipped=1, reason="non-finite loss")
    assert not math.isfinite(out[0][1].loss)


def test_skip_window_with_non_finite_gradient_and_finite_loss() -> None:
    windows = windows_for_skip_tests()
    model = make_mlp()
    ref, _ = reference_skipping(model, windows, {2})

    def sabotage(i, loss, n):
        if i != 2:
            return loss, n
        w = model.out.weight
        # value 0 (finite loss) but d sqrt(x)/dx = inf at x = 0: a NaN gradient
        return loss + 0.0 * torch.sqrt(w.sum() - w.sum()), n

    out = run_with_sabotage(model, windows, sabotage)
    check_skip(*out, model, ref, skipped=2, reason="non-finite gradient")
    assert math.isfinite(out[0][2].loss)


def test_skip_with_grad_scaler_backs_off_the_scale() -> None:
    windows = windows_for_skip_tests()
    model = make_mlp()
    ref, _ = reference_skipping(model, windows, {1})
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1000)
    out = run_with_sabotage(
        model, windows, lambda i, loss, n: (loss * math.inf if i == 1 else loss, n), scaler=scaler
    )
    check_skip(*out, model, ref, skipped=1, reason="non-finite")
    assert scaler.get_scale() == 2.0**7  # the scaler still updated (backed off once)


def test_first_window_skipped_then_normal() -> None:
    windows = windows_for_skip_tests()
    windows[0]["y"][:] = IGNORE
    model = make_mlp()
    before = params(model)
    ref, _ = reference_skipping(model, windows, {0})
    opt = make_opt(model)
    sched = make_sched(opt)
    stats = run_fullbatch(model, opt, windows, micro_batch_size=4, scheduler=sched)
    assert [s.skipped for s in stats] == [True, False, False, False]
    assert [s.steps for s in stats] == [0, 1, 2, 3]
    assert math.isnan(stats[0].loss) and math.isnan(stats[0].grad_norm)
    assert [s.lr for s in stats] == pytest.approx([0.1, 0.1, 0.05, 0.025], rel=1e-15)
    assert rel_err(params(model), ref[-1]) < 1e-10
    assert not all(torch.equal(a, b) for a, b in zip(before, params(model), strict=True))


# -- discard and window boundaries -------------------------------------------------------------


def numbered_micro_batches(n: int) -> list[dict]:
    return [class_batch(1, seed=i) | {"i": torch.tensor([i])} for i in range(n)]


@pytest.mark.parametrize("yielded", [1, 2])
def test_discard_keeps_window_boundaries(yielded: int) -> None:
    """A discarded window's micro-batches are either all dropped (the next window is the next
    K) or all handed on to the next window; never some of each."""
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    windows = []
    with fb.Accumulator(model, opt, micro_batches=4) as acc:
        for window in acc.windows(numbered_micro_batches(12)):
            got = []
            for micro in window:
                got.append(int(micro["i"]))
                window.backward(*fb.cross_entropy_sum(model(micro["x"]), micro["y"]))
                if window.index == 0 and len(got) == yielded:
                    break
            if window.index == 0:
                window.discard()
            else:
                window.step()
            windows.append(got)
    dropped = [list(range(yielded)), [4, 5, 6, 7], [8, 9, 10, 11]]
    handed_on = [list(range(yielded)), list(range(yielded, yielded + 4))]
    assert windows == dropped or windows[:2] == handed_on, windows


def test_discard_of_a_whole_window_keeps_boundaries() -> None:
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    windows = []
    with fb.Accumulator(model, opt, micro_batches=3) as acc:
        for window in acc.windows(numbered_micro_batches(8)):
            got = []
            for micro in window:
                got.append(int(micro["i"]))
                window.backward(*fb.cross_entropy_sum(model(micro["x"]), micro["y"]))
            if window.index == 1:
                window.discard()
            else:
                assert window.step().micro_batches == len(got)
            windows.append(got)
    assert windows == [[0, 1, 2], [3, 4, 5], [6, 7]]


@pytest.mark.parametrize("value", [-1, math.nan, math.inf, torch.tensor(-2.0), "n"], ids=repr)
def test_counts_function_returning_a_bad_value(s: Setup, value) -> None:
    snap = s.snapshot()
    with s.acc(counts={"n": lambda m: value}) as acc, pytest.raises(ValueError, match="count"):
        next(iter(acc.windows([s.batch])))
    s.assert_unchanged(snap)


def test_len_of_a_window_counts_its_micro_batches() -> None:
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lengths = []
    with fb.Accumulator(model, opt, micro_batches=3) as acc:
        for window in acc.windows(iter(numbered_micro_batches(7))):
            lengths.append(len(window))
            for i, micro in enumerate(window):
                assert len(window) == lengths[-1], i  # stable while iterating
                window.backward(*fb.cross_entropy_sum(model(micro["x"]), micro["y"]))
            assert window.step().micro_batches == lengths[-1]
    assert lengths == [3, 3, 1]

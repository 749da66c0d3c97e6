"""Leftovers of a half-migrated loop and unplanned batch shapes: fullbatch raises or warns.

Each test first shows what the mistake would do (the silent result), then that fullbatch
refuses it, before anything changes, or handles it exactly.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import fullbatch as fb
from conftest import (
    IGNORE,
    Snapshot,
    class_batch,
    full_batch_reference,
    lm_batch,
    make_lm,
    make_mlp,
    params,
    rel_err,
    sgd_update,
)
from fullbatch._base._split import count_rows

# -- 1. a loader item that is a list of per-row dicts -------------------------------------------


def per_row_dicts(rows: int = 6, tokens: int = 8) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [{"input_ids": torch.randint(1, 17, (tokens,), generator=g)} for _ in range(rows)]


def lm_loss(model, micro):
    return fb.causal_lm_loss(model(micro["input_ids"]), micro["input_ids"])


def test_per_row_dicts_would_split_the_token_axis_and_are_collated_instead() -> None:
    rows = per_row_dicts()
    # the silent mistake: the first tensor leaf's first dimension is the token axis (8)
    assert rows[0]["input_ids"].shape[0] == 8 and len(rows) == 6
    model = make_lm()
    ids = torch.stack([r["input_ids"] for r in rows])
    ref = full_batch_reference(model, {"input_ids": ids, "labels": ids})
    update, stats = sgd_update(model, [rows], loss=lm_loss, micro_batch_size=4)
    assert stats.count == 6 * 7  # 42 predicted tokens, not 24
    assert stats.micro_batches == 2  # 6 rows in micro-batches of 4: 4 + 2
    assert rel_err(update, ref.grads) < 1e-12


def test_per_row_dicts_of_different_lengths_are_refused() -> None:
    rows = per_row_dicts()
    rows[2] = {"input_ids": rows[2]["input_ids"][:5]}
    model = make_lm()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    snap = Snapshot.take(model, opt)
    with fb.Accumulator(model, opt, micro_batch_size=2) as acc:
        with pytest.raises(ValueError, match=r"list of 6 per-row dicts.*collate_fn that pads"):
            next(iter(acc.windows([rows])))
    snap.assert_same(model, opt)


def test_counting_rows_of_an_uncollated_list_raises() -> None:
    with pytest.raises(ValueError, match="per-row records"):
        count_rows(per_row_dicts())


# -- 2. a leftover optimizer.step() or zero_grad() ----------------------------------------------


def setup_mlp():
    model = make_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, opt, [class_batch(6, seed=i, ignore=(1,)) for i in range(2)]


def ce(model, micro):
    return fb.cross_entropy_sum(model(micro["x"]), micro["y"])


def test_leftover_optimizer_step_inside_a_window_raises_before_stepping() -> None:
    model, opt, data = setup_mlp()
    snap = Snapshot.take(model, opt)
    with fb.Accumulator(model, opt, micro_batch_size=2) as acc:
        with pytest.raises(RuntimeError, match=r"optimizer.step\(\) was called inside window 0"):
            for window in acc.windows(data):
                for micro in window:
                    window.backward(*ce(model, micro))
                    opt.step()  # the old loop's step
                window.step()
    snap.assert_same(model, opt)


def test_user_step_hooks_and_steps_outside_windows_still_work() -> None:
    model, opt, data = setup_mlp()
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append(1))
    with fb.Accumulator(model, opt, micro_batch_size=2) as acc:
        for window in acc.windows(data):
            for micro in window:
                window.backward(*ce(model, micro))
            window.step()
        opt.step()  # between windows there is no window gradient to corrupt
    assert len(seen) == 3


@pytest.mark.parametrize(
    "clear",
    [
        lambda m, o: o.zero_grad(),
        lambda m, o: o.zero_grad(set_to_none=False),
        lambda m, o: m.zero_grad(),
        lambda m, o: torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3),
    ],
    ids=["optimizer.zero_grad", "zero_grad(set_to_none=False)", "model.zero_grad", "clip"],
)
def test_leftover_zero_grad_between_micro_batches_raises(clear) -> None:
    model, opt, data = setup_mlp()
    snap = Snapshot.take(model, opt)
    with fb.Accumulator(model, opt, micro_batch_size=2) as acc:
        with pytest.raises(RuntimeError, match=r"window 0 were cleared or changed.*zero_grad"):
            for window in acc.windows(data):
                for micro in window:
                    clear(model, opt)  # the old loop's zero_grad at the top of each iteration
                    window.backward(*ce(model, micro))
                window.step()
        assert all(p.grad is None for p in model.parameters())  # the window was discarded
    snap.assert_same(model, opt)


def test_leftover_loss_backward_next_to_window_backward_raises() -> None:
    model, opt, data = setup_mlp()
    snap = Snapshot.take(model, opt)
    with fb.Accumulator(model, opt, micro_batch_size=2) as acc:
        with pytest.raises(RuntimeError, match=r"loss.backward\(\)"):
            for window in acc.windows(data):
                for micro in window:
                    loss_sum, n = ce(model, micro)
                    (loss_sum / n).backward(retain_graph=True)  # the old loop's backward
                    window.backward(loss_sum, n)
                window.step()
    snap.assert_same(model, opt)


def test_leftover_loss_backward_in_a_one_micro_batch_window_raises() -> None:
    model, opt, data = setup_mlp()
    with fb.Accumulator(model, opt, micro_batch_size=6) as acc:
        window = next(iter(acc.windows(data)))
        micro = next(iter(window))
        loss_sum, n = ce(model, micro)
        (loss_sum / n).backward(retain_graph=True)
        with pytest.raises(RuntimeError, match=r"loss.backward\(\)"):
            window.backward(loss_sum, n)
    assert all(p.grad is None for p in model.parameters())


def test_zero_grad_after_the_last_backward_raises_at_step() -> None:
    model, opt, data = setup_mlp()
    snap = Snapshot.take(model, opt)
    with fb.Accumulator(model, opt, micro_batch_size=2) as acc:
        window = next(iter(acc.windows(data)))
        for micro in window:
            window.backward(*ce(model, micro))
        opt.zero_grad()
        with pytest.raises(RuntimeError, match=r"before window.step\(\)"):
            window.step()
    snap.assert_same(model, opt)


def test_zero_grad_before_the_first_backward_is_harmless() -> None:
    model, opt, data = setup_mlp()
    ref_model, ref_opt, _ = setup_mlp()
    with fb.Accumulator(model, opt, micro_batch_size=2) as acc:
        for window in acc.windows(data):
            opt.zero_grad()  # nothing accumulated yet: nothing lost
            for micro in window:
                window.backward(*ce(model, micro))
            window.step()
    with fb.Accumulator(ref_model, ref_opt, micro_batch_size=2) as acc:
        for window in acc.windows(data):
            for micro in window:
                window.backward(*ce(ref_model, micro))
            window.step()
    assert all(torch.equal(a, b) for a, b in zip(params(model), params(ref_model), strict=True))


# -- 3. a scheduler stepped twice ---------------------------------------------------------------


def test_scheduler_stepped_in_the_loop_and_by_fullbatch_raises() -> None:
    model, opt, data = setup_mlp()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with fb.Accumulator(model, opt, micro_batch_size=2, scheduler=sched) as acc:
        with pytest.raises(RuntimeError, match=r"scheduler.step\(\) was called outside"):
            for window in acc.windows(data):
                for micro in window:
                    window.backward(*ce(model, micro))
                window.step()
                sched.step()  # leftover: the LR would decay twice per step
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**2)  # the user's own call
    assert acc.steps == 1  # the second window never stepped with the doubly decayed LR


def test_scheduler_stepped_inside_a_window_raises_at_step_and_changes_nothing() -> None:
    model, opt, data = setup_mlp()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    before = params(model)
    with fb.Accumulator(model, opt, micro_batch_size=2, scheduler=sched) as acc:
        window = next(iter(acc.windows(data)))
        for micro in window:
            window.backward(*ce(model, micro))
            sched.step()
        with pytest.raises(RuntimeError, match="last_epoch moved from 0 to 3"):
            window.step()
    assert all(torch.equal(a, b) for a, b in zip(before, params(model), strict=True))
    assert not opt.state  # AdamW never stepped: no moments
    assert all(p.grad is None for p in model.parameters())


# -- 4. an optimizer built on other parameters --------------------------------------------------


def test_optimizer_of_another_model_is_refused() -> None:
    model = make_mlp()
    other = make_mlp()  # e.g. built before copy.deepcopy(model), or before fully_shard
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"none of the model's 4 trainable parameters"):
        fb.Accumulator(model, opt, micro_batch_size=2)


# -- 5. skipped windows warn (rate-limited) and are counted -------------------------------------


def test_skipped_windows_warn_at_powers_of_two_and_are_counted() -> None:
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [class_batch(4, seed=i, ignore=range(4)) for i in range(5)]  # zero items each
    data.insert(2, class_batch(4, seed=9))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fb.Accumulator(model, opt, micro_batch_size=2) as acc:
            stats = []
            for window in acc.windows(data):
                for micro in window:
                    window.backward(*ce(model, micro))
                stats.append(window.step())
    assert [s.skipped for s in stats] == [True, True, False, True, True, True]
    assert [s.skipped_windows for s in stats] == [1, 2, 2, 3, 4, 5]
    skips = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(skips) == 3  # the 1st, 2nd and 4th skip
    assert "window 0 was skipped (no items counted in the window)" in str(skips[0].message)
    assert "4 window(s) skipped so far, 1 stepped" in str(skips[2].message)
    assert skips[0].filename == __file__  # points at the user's window.step()


# -- 9. pre-shifted targets ignored as -1 (nanoGPT, LLMs-from-scratch) ---------------------------


def nanogpt_batch():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 17, (4, 8), generator=g)
    y = torch.roll(x, -1, dims=1)  # targets already shifted
    y[:, -1] = -1
    y[0, 4:] = -1
    return x, y


def test_minus_one_targets_are_refused_with_the_fix() -> None:
    _, y = nanogpt_batch()
    logits = torch.randn(4, 8, 17)
    # silently wrong before: -1 counted as an item
    assert int((y[:, 1:] != IGNORE).sum()) != int((y != -1).sum())
    with pytest.raises(ValueError, match=r"labels contain -1.*ignore_index=-1.*already shifted"):
        fb.count_tokens(y)
    with pytest.raises(ValueError, match=r"ignore_index=-1"):
        fb.cross_entropy_sum(logits, y)
    with pytest.raises(ValueError, match=r"fb.cross_entropy_sum\(logits, targets, ignore_index=-1"):
        fb.causal_lm_loss(logits, y)
    with pytest.raises(ValueError, match="integer class indices"):
        fb.cross_entropy_sum(logits, y.float())


def test_recipe_for_pre_shifted_targets_matches_the_full_batch() -> None:
    x, y = nanogpt_batch()
    model = make_lm()
    logits = model(x)
    loss_sum, n = fb.cross_entropy_sum(logits, y, ignore_index=-1)
    assert int(n) == int(fb.count_tokens(y, ignore_index=-1, shift=False)) == 4 * 8 - 4 - 3
    want = F.cross_entropy(logits.reshape(-1, 17), y.reshape(-1), ignore_index=-1)
    assert float(loss_sum / n) == pytest.approx(float(want), rel=1e-12)


# -- 13. len(acc.windows(loader)) --------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,items,want",
    [
        ({"micro_batches": 3}, 7, 3),
        ({"micro_batches": 3, "partial_window": "drop"}, 7, 2),
        ({"micro_batches": 3}, 6, 2),
        ({"micro_batch_size": 2}, 5, 5),
        ({"micro_batches": 4}, 0, 0),
    ],
)
def test_len_of_windows(kwargs, items: int, want: int) -> None:
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [class_batch(4, seed=i) for i in range(items)]
    with fb.Accumulator(model, opt, **kwargs) as acc:
        windows = acc.windows(data)
        assert len(windows) == want
        made = 0
        for window in windows:
            for micro in window:
                window.backward(*ce(model, micro))
            window.step()
            made += 1
    assert made == want


def test_len_of_windows_needs_a_sized_loader() -> None:
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with fb.Accumulator(model, opt, micro_batches=2) as acc:
        with pytest.raises(TypeError, match="needs a loader with a length; a generator"):
            len(acc.windows(class_batch(4, seed=i) for i in range(3)))


def test_lm_batch_still_splits_by_rows() -> None:
    """Regular collated batches are untouched by the per-row check."""
    batch = lm_batch([3, 5, 2, 4])
    assert count_rows(batch) == 4
    assert math.isfinite(float(batch["labels"].sum()))

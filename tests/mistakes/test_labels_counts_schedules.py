"""Issue 18: migration mistakes that trained silently wrong now raise or warn with the fix.

Each row: the mistake is made through fullbatch and refused (or warned) before anything
changes, and the correct form next to it says nothing. The error each mistake caused before is
measured by ``benchmarks/mistakes.py`` (the table in docs/mistakes.md).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import fullbatch as fb
from conftest import IGNORE, PAD_ID, Snapshot, class_batch, lm_batch, make_lm, make_mlp

LENGTHS = (7, 3, 5, 2, 6, 4)


def _lm_setup(lr: float = 0.05):
    model = make_lm()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    return model, opt, lm_batch(LENGTHS, seed=1)


def _run_one_window(model, opt, batch, loss, **acc_kwargs) -> fb.StepStats:
    with fb.Accumulator(model, opt, micro_batch_size=2, **acc_kwargs) as acc:
        for window in acc.windows([batch]):
            for micro in window:
                window.backward(*loss(model, micro))
            return window.step()
    raise AssertionError("no window")


def _quiet():
    """Every warning becomes an error: the correct forms must not warn."""
    context = warnings.catch_warnings()
    context.__enter__()
    warnings.simplefilter("error")
    return context


def _unchanged(snap: Snapshot, model, opt) -> None:
    snap.assert_same(model, opt)
    assert all(p.grad is None for p in model.parameters())


# -- scheduler.step() once per micro-batch, no scheduler= ------------------------------------


def test_scheduler_stepped_per_micro_batch_raises_and_changes_nothing() -> None:
    model, opt, batch = _lm_setup()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    snap = Snapshot.take(model, opt)
    with fb.Accumulator(model, opt, micro_batch_size=2) as acc:
        with pytest.raises(RuntimeError, match=r"learning rate changed between two backward") as e:
            for window in acc.windows([batch]):
                for micro in window:
                    window.backward(*fb.causal_lm_loss(model(micro["input_ids"]), micro["labels"]))
                    sched.step()  # the mistake: once per micro-batch
                window.step()
    assert "Pass scheduler= to the Accumulator" in str(e.value)
    assert "[0.05] to [0.025]" in str(e.value)
    assert acc.steps == 0
    params_and_state = Snapshot.take(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(snap.params, params_and_state.params, strict=True))
    assert not opt.state  # AdamW never stepped
    assert all(p.grad is None for p in model.parameters())


def test_lr_set_per_window_or_stepped_after_the_window_does_not_raise() -> None:
    model, opt, _ = _lm_setup()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    data = [lm_batch(LENGTHS, seed=s) for s in range(3)]
    quiet = _quiet()
    try:
        with fb.Accumulator(model, opt, micro_batch_size=2) as acc:
            for w, window in enumerate(acc.windows(data)):
                for micro in window:
                    for group in opt.param_groups:  # the same value at every micro-batch
                        group["lr"] = 0.05 / (w + 1)
                    window.backward(*fb.causal_lm_loss(model(micro["input_ids"]), micro["labels"]))
                for group in opt.param_groups:  # set after the last backward: fine
                    group["lr"] = group["lr"] * 0.9
                window.step()
                sched.step()  # once per optimizer step: fine
    finally:
        quiet.__exit__(None, None, None)
    assert acc.steps == 3


# -- labels already shifted, passed to fb.causal_lm_loss (shifted twice) ----------------------


def _pre_shifted(batch):
    """Hugging Face style: ``labels[:, :-1] = input_ids[:, 1:]``, -100 on padding and last."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    labels = torch.full_like(ids, IGNORE)
    labels[:, :-1] = ids[:, 1:].masked_fill(mask[:, 1:] == 0, IGNORE)
    return {**batch, "labels": labels}


def test_pre_shifted_labels_in_causal_lm_loss_raise_and_change_nothing() -> None:
    model, opt, batch = _lm_setup()
    snap = Snapshot.take(model, opt)

    def shifted_twice(model, micro):
        return fb.causal_lm_loss(model(micro["input_ids"]), micro["labels"])

    with pytest.raises(ValueError, match=r"labels are already shifted") as e:
        _run_one_window(model, opt, _pre_shifted(batch), shifted_twice)
    assert "fb.cross_entropy_sum(logits, labels)" in str(e.value)
    _unchanged(snap, model, opt)


def test_pre_shifted_labels_with_a_non_shifting_loss_do_not_warn() -> None:
    model, opt, batch = _lm_setup()

    def no_shift(model, micro):
        return fb.cross_entropy_sum(model(micro["input_ids"]), micro["labels"])

    def shift(model, micro):
        return fb.causal_lm_loss(model(micro["input_ids"]), micro["labels"])

    quiet = _quiet()
    try:
        _run_one_window(model, opt, _pre_shifted(batch), no_shift)
        _run_one_window(model, opt, batch, shift)  # unshifted labels, shifted once
    finally:
        quiet.__exit__(None, None, None)


# -- padding labelled with the pad id instead of -100 ----------------------------------------


def test_padding_labelled_with_the_pad_id_raises_and_changes_nothing() -> None:
    model, opt, batch = _lm_setup()
    batch = {**batch, "labels": batch["input_ids"].clone()}  # pad id 0 on padding
    snap = Snapshot.take(model, opt)

    def loss(model, micro):
        return fb.causal_lm_loss(model(micro["input_ids"]), micro["labels"])

    with pytest.raises(ValueError, match=r"labels are counted where attention_mask is 0") as e:
        _run_one_window(model, opt, batch, loss)
    assert "masked_fill(attention_mask == 0, -100)" in str(e.value)
    _unchanged(snap, model, opt)


def test_pad_id_as_ignore_index_and_a_first_padding_target_do_not_warn() -> None:
    model, opt, batch = _lm_setup()
    pad_labels = {**batch, "labels": batch["input_ids"].clone()}

    def ignore_pad(model, micro):
        return fb.causal_lm_loss(model(micro["input_ids"]), micro["labels"], ignore_index=PAD_ID)

    # an end-of-sequence target on the first padding position (predicted from a real token)
    eos = batch["labels"].clone()
    ends = batch["attention_mask"].sum(dim=1)
    for row, end in enumerate(ends.tolist()):
        if end < eos.shape[1]:
            eos[row, end] = 1

    def loss(model, micro):
        return fb.causal_lm_loss(model(micro["input_ids"]), micro["labels"])

    quiet = _quiet()
    try:
        _run_one_window(model, opt, pad_labels, ignore_pad)
        _run_one_window(model, opt, {**batch, "labels": eos}, loss)
    finally:
        quiet.__exit__(None, None, None)


# -- summed loss with the unshifted count (attention_mask.sum()) ------------------------------


def test_unshifted_count_warns_before_the_backward() -> None:
    model, opt, batch = _lm_setup()
    snap = Snapshot.take(model, opt)

    def mask_count(model, micro):
        loss_sum, _ = fb.causal_lm_loss(model(micro["input_ids"]), micro["labels"])
        return loss_sum, micro["attention_mask"].sum()

    with pytest.warns(UserWarning, match=r"count \d+ includes each row's first label") as rec:
        _run_one_window(model, opt, batch, mask_count)
    assert "fb.causal_lm_loss(logits, labels)" in str(rec[0].message)
    # raised as an error, the warning comes before anything changed
    model, opt, batch = _lm_setup()
    quiet = _quiet()
    try:
        with pytest.raises(UserWarning, match="includes each row's first label"):
            _run_one_window(model, opt, batch, mask_count)
    finally:
        quiet.__exit__(None, None, None)
    _unchanged(snap, model, opt)


def test_token_classification_count_does_not_warn() -> None:
    """Labels that are not a copy of the inputs, counted unshifted: a per-token classifier."""
    model, opt, batch = _lm_setup()
    tags = (batch["input_ids"] % 3).masked_fill(batch["attention_mask"] == 0, IGNORE)

    def tagger(model, micro):
        return fb.cross_entropy_sum(model(micro["input_ids"]), micro["labels"])

    quiet = _quiet()
    try:
        _run_one_window(model, opt, {**batch, "labels": tags}, tagger)
    finally:
        quiet.__exit__(None, None, None)


# -- F.cross_entropy(reduction="mean") passed with count n: verify's additivity ---------------


def test_mean_loss_with_its_count_is_caught_by_verify() -> None:
    """A loss value has no unit, so the Accumulator cannot tell a mean from a sum; verify can."""
    model = make_mlp()
    batch = class_batch(8, seed=2, ignore=(1, 2, 5))

    def mean_with_count(model, micro):
        logits = model(micro["x"])
        n = (micro["y"] != IGNORE).sum()
        return F.cross_entropy(logits, micro["y"], ignore_index=IGNORE, reduction="mean"), n

    report = fb.verify(model, batch, mean_with_count, micro_batch_size=2)
    assert not report.passed
    assert any("mean" in line for line in report.diagnosis), report.diagnosis

    def sum_with_count(model, micro):
        return fb.cross_entropy_sum(model(micro["x"]), micro["y"])

    assert fb.verify(model, batch, sum_with_count, micro_batch_size=2).passed


# -- counts= share form without dividing by window.totals ------------------------------------


def _share_run(divide: bool) -> None:
    model, opt, batch = _lm_setup()
    counts = {"tokens": lambda m: fb.count_tokens(m["labels"])}
    with fb.Accumulator(model, opt, micro_batch_size=2, counts=counts) as acc:
        for window in acc.windows([batch]):
            for micro in window:
                loss_sum, _ = fb.causal_lm_loss(model(micro["input_ids"]), micro["labels"])
                window.backward(loss_sum / window.totals["tokens"] if divide else loss_sum)
            window.step()


def test_share_form_without_totals_warns_before_the_backward() -> None:
    model, opt, _ = _lm_setup()
    snap = Snapshot.take(model, opt)
    with pytest.warns(UserWarning, match=r"never read window.totals") as rec:
        _share_run(divide=False)
    assert "loss_sum / window.totals['tokens']" in str(rec[0].message)
    quiet = _quiet()
    try:
        with pytest.raises(UserWarning, match=r"never read window\.totals"):
            _share_run(divide=False)
        _share_run(divide=True)  # the correct form: silent
    finally:
        quiet.__exit__(None, None, None)
    _unchanged(snap, model, opt)


# -- an optimizer built on a subset of the parameters -----------------------------------------


def test_optimizer_on_some_parameters_warns_at_construction() -> None:
    model = make_lm()
    opt = torch.optim.SGD(model.out.parameters(), lr=0.1)
    with pytest.warns(
        UserWarning, match=r"3 of the model's 5 trainable parameters \(embed.weight"
    ) as rec:
        fb.Accumulator(model, opt, micro_batch_size=2).close()
    assert "requires_grad_(False)" in str(rec[0].message)
    quiet = _quiet()
    try:
        fb.Accumulator(
            model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=2
        ).close()
        for module in (model.embed, model.mix):
            module.requires_grad_(False)  # frozen on purpose: no warning
        fb.Accumulator(model, opt, micro_batch_size=2).close()
    finally:
        quiet.__exit__(None, None, None)


# -- a list of per-row dicts with micro_batches=K ---------------------------------------------


def test_per_row_dicts_with_micro_batches_warn_once() -> None:
    model, opt, batch = _lm_setup()
    rows = [{k: v[i] for k, v in batch.items()} for i in range(2)]
    snap = Snapshot.take(model, opt)
    quiet = _quiet()
    try:
        with fb.Accumulator(model, opt, micro_batches=2) as acc:
            window = next(iter(acc.windows([rows, rows])))
            with pytest.raises(UserWarning, match=r"a list of 2 per-row records.*Collate rows"):
                next(iter(window))
            window.discard()
    finally:
        quiet.__exit__(None, None, None)
    _unchanged(snap, model, opt)
    collated = [{k: v[:2] for k, v in batch.items()}, {k: v[2:4] for k, v in batch.items()}]
    quiet = _quiet()
    try:
        with fb.Accumulator(model, opt, micro_batches=2) as acc:
            for window in acc.windows(collated):
                for micro in window:
                    window.backward(*fb.causal_lm_loss(model(micro["input_ids"]), micro["labels"]))
                window.step()
    finally:
        quiet.__exit__(None, None, None)


def test_a_tensor_learning_rate_changed_per_micro_batch_raises_too() -> None:
    model, _, batch = _lm_setup()
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.05), foreach=False)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with fb.Accumulator(model, opt, micro_batch_size=2) as acc:
        with pytest.raises(RuntimeError, match=r"learning rate changed between two backward"):
            for window in acc.windows([batch]):
                for micro in window:
                    window.backward(*fb.causal_lm_loss(model(micro["input_ids"]), micro["labels"]))
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        sched.step()
                window.step()
    assert not opt.state


def test_attention_mask_count_with_masked_prompts_warns() -> None:
    """Prompt tokens labelled -100: attention_mask.sum() is neither count of the labels."""
    model, opt, batch = _lm_setup()
    labels = batch["labels"].clone()
    labels[:, :2] = IGNORE  # a two-token prompt per row

    def mask_count(model, micro):
        loss_sum, _ = fb.causal_lm_loss(model(micro["input_ids"]), micro["labels"])
        return loss_sum, micro["attention_mask"].sum()

    with pytest.warns(UserWarning, match=r"includes each row's first label"):
        _run_one_window(model, opt, {**batch, "labels": labels}, mask_count)

    def right(model, micro):
        return fb.causal_lm_loss(model(micro["input_ids"]), micro["labels"])

    model, opt, batch = _lm_setup()
    quiet = _quiet()
    try:
        _run_one_window(model, opt, {**batch, "labels": labels}, right)
    finally:
        quiet.__exit__(None, None, None)

"""The trimming check (issue 31, item 4): refuse a window only where trimming would change what
is counted, never an input whose cut columns the attention mask marks as padding.

A collator may leave several values in ``input_ids``' padding (an end-of-sequence token on the
first padding position, then the pad id; or junk from a reused buffer). The mask marks those
positions as padding and the labels are -100 there, so cutting them cannot change the loss:
every length-aware mode must take such a window and stay equal to the float64 full batch. A
label (or a loss mask) that holds something past the rows' lengths is still refused, and so is
an input without a mask that defines its padding (lengths from a callable).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import fullbatch as fb
from _mistake_cases import IGNORE, PAD, flat, full_batch_grad, loss, one_step, rel, tiny_llama
from _mistake_cases import window as make_window
from conftest import Snapshot

EOS = 2
LENGTHS = (24, 5, 17, 9, 21, 6, 13, 11)


def _mixed_padding(seed: int = 0) -> dict[str, torch.Tensor]:
    """A right-padded window, 4 columns wider than its longest row, whose input_ids padding is
    EOS, then PAD or junk ids."""
    batch = _wide(make_window(LENGTHS, seed=seed))
    ids = batch["input_ids"].clone()
    g = torch.Generator().manual_seed(seed + 1)
    for row, n in enumerate(LENGTHS):
        if n < ids.shape[1]:
            ids[row, n] = EOS
            tail = ids.shape[1] - n - 1
            ids[row, n + 1 :] = torch.where(
                torch.rand(tail, generator=g) < 0.5, PAD, torch.randint(3, 60, (tail,), generator=g)
            )
    return {**batch, "input_ids": ids}


def _wide(batch: dict[str, torch.Tensor], extra: int = 4) -> dict[str, torch.Tensor]:
    pads = {"input_ids": PAD, "attention_mask": 0, "labels": IGNORE}
    return {k: torch.nn.functional.pad(v, (0, extra), value=pads[k]) for k, v in batch.items()}


def _body(model):
    def body(win, micro):
        if "cu_seq_lens_q" in micro:  # packed: the documented call (position_ids, no mask)
            logits = model(**{k: v for k, v in micro.items() if k != "labels"}).logits
            win.backward(*fb.causal_lm_loss(logits, micro["labels"]))
        else:
            win.backward(*loss(model, micro))

    return body


def _run_step(model, batch, **options):
    """One window through window.run (needed by "auto"): the SGD(lr=1) update and stats."""
    before = flat(model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with fb.Accumulator(model, opt, **options) as acc:
        for win in acc.windows([batch]):
            stats = win.run(lambda micro: loss(model, micro))
            break
    return before - flat(model), stats


@pytest.mark.parametrize(
    "options",
    [
        {"micro_batch_tokens": 48},
        {"micro_batch_size": 3, "sort_rows": True},
        {"micro_batch_tokens": 48, "pack": True},
    ],
    ids=["tokens", "sort_rows", "pack"],
)
def test_input_padding_of_several_values_under_the_mask_is_trimmed_exactly(options) -> None:
    batch = _mixed_padding()
    assert len(set(batch["input_ids"][batch["attention_mask"] == 0].tolist())) > 2
    model = tiny_llama()
    want = full_batch_grad(model, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        update, stats = one_step(model, [batch], _body(model), **options)
    assert stats.micro_batches > 1
    assert rel(update, want) < 1e-6  # float64 Llama: its rotary tables round at 5e-8
    # bitwise the update of the same window padded with PAD alone: the mask hides the values
    model = tiny_llama()
    plain, _ = one_step(model, [_wide(make_window(LENGTHS))], _body(model), **options)
    assert torch.equal(update, plain)


@pytest.mark.parametrize("auto", ["micro_batch_size", "micro_batch_tokens"])
def test_auto_takes_the_same_window(auto) -> None:
    batch = _mixed_padding(seed=3)
    model = tiny_llama()
    want = full_batch_grad(model, batch)
    options = {auto: "auto"} if auto == "micro_batch_tokens" else {auto: "auto", "sort_rows": True}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        update, stats = _run_step(model, batch, **options)
    assert stats.count == int((batch["labels"][:, 1:] != IGNORE).sum())
    assert rel(update, want) < 1e-6  # float64 Llama: its rotary tables round at 5e-8


def test_a_label_on_the_first_padding_position_is_still_refused() -> None:
    batch = _mixed_padding()
    labels = batch["labels"].clone()
    # an end-of-sequence label the full batch would count, on the first padding position of
    # the longest row of its micro-batch (lengths 11, 9, 6, 5 share one): trimming cuts it
    labels[7, LENGTHS[7]] = EOS
    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    snap = Snapshot.take(model, opt)
    with fb.Accumulator(model, opt, micro_batch_tokens=48) as acc:
        with pytest.raises(ValueError, match=r"item\['labels'\] holds values other than padding"):
            next(iter(acc.windows([{**batch, "labels": labels}])))
    snap.assert_same(model, opt)


def test_a_loss_mask_past_the_lengths_is_refused() -> None:
    batch = _mixed_padding()
    weights = batch["attention_mask"].clone()
    weights[2, LENGTHS[2] + 1] = 1  # a weight the full batch counts, on a padding position
    model = tiny_llama()
    with fb.Accumulator(model, torch.optim.SGD(model.parameters()), micro_batch_size=2,
                        sort_rows=True) as acc:  # fmt: skip
        with pytest.raises(ValueError, match=r"item\['loss_mask'\] holds values other than"):
            next(iter(acc.windows([{**batch, "loss_mask": weights}])))


def test_inputs_without_a_mask_that_defines_their_padding_are_still_checked() -> None:
    batch = _mixed_padding()
    lengths = batch.pop("attention_mask").sum(1)
    model = tiny_llama()
    with fb.Accumulator(model, torch.optim.SGD(model.parameters()), micro_batch_tokens=48,
                        lengths=lambda item: lengths) as acc:  # fmt: skip
        with pytest.raises(ValueError, match=r"item\['input_ids'\] holds values other than"):
            next(iter(acc.windows([batch])))

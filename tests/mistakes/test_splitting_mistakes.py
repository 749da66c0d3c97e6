"""Issue 26: the window size given in the wrong unit, and rows cut or joined wrongly.

Errors quoted from ``python benchmarks/mistakes.py --table migration`` (tiny Llama, float64);
the tests show each mistake wrong on their own small models, then refused or warned.

- ``micro_batch_size=M`` with a loader that already yields M-row micro-batches: every window
  is one micro-batch, nothing accumulates (4 steps instead of 1): warned with
  ``micro_batches=K``.
- ``micro_batches=K`` with a loader of whole batches: a window of K batches (88% off on the
  first step). Warned when the loader has fewer than K items; a longer loader of whole
  batches cannot be told from a loader of micro-batches (documented).
- ``fb.row_windows`` joining left-padded prompts without ``left=``: padding on both sides of
  the joined rows (40% off): refused with ``left=``.
- ``micro_batch_tokens``: a per-row ``[rows, W]`` tensor whose W equals the padded width was
  trimmed (7.9% off): an unknown key that wide is refused, naming ``token_keys=``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import fullbatch as fb
from _mistake_cases import IGNORE, flat, flat_grad, one_step, rel
from conftest import Snapshot, fb_loss, full_batch_reference, lm_batch, make_lm

LENGTHS = (7, 3, 5, 2, 6, 4, 8, 5)


def full_batch_grad(model, batch) -> torch.Tensor:
    return torch.cat([g.flatten() for g in full_batch_reference(model, batch).grads])


def _quiet_step(model, loader, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return one_step(model, loader, lambda w, m: w.backward(*fb_loss(model, m)), **options)


def _steps(loader, **options) -> int:
    model = make_lm()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with fb.Accumulator(model, opt, **options) as acc:
        for win in acc.windows(loader):
            for micro in win:
                win.backward(*fb_loss(model, micro))
            win.step()
    return acc.steps


# -- micro_batch_size=M with a loader of M-row micro-batches -----------------------------------


def _micros(batch, size: int = 2):
    rows = batch["input_ids"].shape[0]
    return [{k: v[i : i + size] for k, v in batch.items()} for i in range(0, rows, size)]


def test_micro_batch_size_on_a_loader_of_micro_batches_warns_before_the_first_step() -> None:
    micros = _micros(lm_batch(LENGTHS))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert _steps(micros, micro_batch_size=2) == 4  # the mistake: no accumulation
    model = make_lm()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    snap = Snapshot.take(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # raised as an error: before anything changed
        with pytest.raises(UserWarning, match=r"a loader item of 2 rows is not larger than"):
            with fb.Accumulator(model, opt, micro_batch_size=2) as acc:
                for win in acc.windows(micros):
                    for micro in win:
                        win.backward(*fb_loss(model, micro))
                    win.step()
    snap.assert_same(model, opt)
    with pytest.warns(UserWarning, match=r"micro_batches=K") as caught:
        _steps(micros, micro_batch_size=2)
    assert sum("nothing is accumulated" in str(w.message) for w in caught) == 1  # once


def test_a_generator_of_micro_batches_warns_at_the_second_window() -> None:
    micros = _micros(lm_batch(LENGTHS))
    with pytest.warns(UserWarning, match="nothing is accumulated"):
        _steps((m for m in micros), micro_batch_size=2)


def test_a_dataloader_with_batch_size_m_warns_before_any_window() -> None:
    rows = [{k: v[i] for k, v in lm_batch(LENGTHS).items()} for i in range(8)]
    loader = torch.utils.data.DataLoader(rows, batch_size=2)
    model = make_lm()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match=r"the DataLoader's batch_size=2 is not larger"):
        with fb.Accumulator(model, opt, micro_batch_size=2) as acc:
            acc.windows(loader)


def test_whole_windows_with_micro_batch_size_stay_silent_and_exact() -> None:
    batch = lm_batch(LENGTHS)
    model = make_lm()
    want = full_batch_grad(model, batch)
    update, stats = _quiet_step(model, [batch, batch], micro_batch_size=2)
    assert stats.micro_batches == 4 and rel(update, want) < 1e-12
    # one window of exactly M rows, alone in its loader: nothing to accumulate, nothing said
    _quiet_step(make_lm(), [batch], micro_batch_size=8)
    loader = torch.utils.data.DataLoader(list(batch["input_ids"]), batch_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with fb.Accumulator(model, torch.optim.SGD(model.parameters()), micro_batch_size=2) as a:
            a.windows(loader)  # batch_size 4 > 2: a loader of windows


# -- micro_batches=K with a loader of whole batches ------------------------------------------


def test_whole_batches_with_micro_batches_make_a_k_times_batch() -> None:
    """Silent when the loader has K items or more: documented (docs/mistakes.md)."""
    batches = [lm_batch(LENGTHS, seed=s) for s in range(4)]
    model = make_lm()
    want = full_batch_grad(model, batches[0])
    update, stats = _quiet_step(model, batches, micro_batches=4)
    assert stats.micro_batches == 4 and rel(update, want) > 0.5


def test_fewer_loader_items_than_micro_batches_warns_with_micro_batch_size() -> None:
    batch = lm_batch(LENGTHS)
    model = make_lm()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    snap = Snapshot.take(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(
            UserWarning, match=r"has 1 item\(s\) but micro_batches=4.*micro_batch_size=M"
        ):
            with fb.Accumulator(model, opt, micro_batches=4) as acc:
                acc.windows([batch])
    snap.assert_same(model, opt)
    # K items or more, or an unsized loader: nothing said
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with fb.Accumulator(model, opt, micro_batches=2) as acc:
            acc.windows(_micros(batch, 4))
            acc.windows(iter([batch]))


# -- fb.row_windows joining left-padded prompts without left= --------------------------------


def _prompts(seed: int, lengths: list[int], width: int, completion: int = 4) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.randint(3, 64, (n,), generator=g)
        mask[row, width - n :] = 1
    done = torch.randint(3, 64, (len(lengths), completion), generator=g)
    return {"prompt_ids": ids, "prompt_mask": mask, "completion_ids": done,
            "completion_mask": torch.ones_like(done)}  # fmt: skip


def _grpo_like(model, w):
    """Completion tokens after their prompt: the logits of the completion positions."""
    ids = torch.cat([w["prompt_ids"], w["completion_ids"]], 1)
    mask = torch.cat([w["prompt_mask"], w["completion_mask"]], 1)
    c = w["completion_ids"].shape[1]
    out = model(input_ids=ids, attention_mask=mask).logits[:, -c - 1 : -1]
    return F.cross_entropy(out.flatten(0, 1), w["completion_ids"].flatten(), reduction="sum")


def test_row_windows_of_left_padded_prompts_without_left_raises() -> None:
    pytest.importorskip("transformers")
    from _mistake_cases import tiny_llama

    a, b = _prompts(1, [3, 5], 5), _prompts(2, [4, 7], 7)
    right = next(fb.row_windows([a, b], rows=4, left=("prompt_ids", "prompt_mask")))
    wrong = {k: torch.cat([F.pad(a[k], (0, 2)), b[k]]) if k.startswith("prompt") else
             torch.cat([a[k], b[k]]) for k in a}  # fmt: skip  # the old join
    model = tiny_llama()
    assert (
        rel(flat_grad(model, _grpo_like(model, wrong)), flat_grad(model, _grpo_like(model, right)))
        > 0.2
    )
    with pytest.raises(ValueError, match=r"left-padded.*left=\('prompt_ids', 'prompt_mask'\)"):
        next(fb.row_windows([a, b], rows=4))
    with pytest.raises(ValueError, match=r"\['prompt_ids'\] would be padded on the right"):
        next(fb.row_windows([a, b], rows=4, left=("prompt_mask",)))


def test_row_windows_without_left_padding_stay_silent() -> None:
    # right-padded masks, equal widths, and a loss mask over varied prompt tokens
    a = lm_batch([3, 5], seed=1, width=5)
    b = lm_batch([4, 7], seed=2, width=7)
    joined = next(fb.row_windows([a, b], rows=4, pad={"labels": IGNORE}))
    assert joined["input_ids"].shape == (4, 7) and joined["labels"][0, 5:].eq(IGNORE).all()
    c, d = _prompts(1, [3, 5], 5), _prompts(2, [2, 4], 5)
    assert next(fb.row_windows([c, d], rows=4))["prompt_ids"].shape == (4, 5)  # no padding
    loss_mask = {"input_ids": torch.randint(3, 64, (2, 5)),
                 "loss_mask": torch.tensor([[0, 0, 1, 1, 1], [0, 0, 0, 1, 1]])}  # fmt: skip
    wide = {"input_ids": torch.randint(3, 64, (2, 7)), "loss_mask": torch.ones(2, 7).long()}
    joined = next(fb.row_windows([loss_mask, wide], rows=4))
    assert joined["loss_mask"][0].tolist() == [0, 0, 1, 1, 1, 0, 0]


# -- micro_batch_tokens: a per-row tensor as wide as the padding ----------------------------


def _styled(batch):
    """A per-row feature vector that happens to be as wide as the padded rows."""
    g = torch.Generator().manual_seed(3)
    style = torch.rand(batch["input_ids"].shape, generator=g, dtype=torch.float64)
    return {**batch, "style": style}


def _weighted(model, micro):
    logits = model(micro["input_ids"])
    per_row = F.cross_entropy(logits[:, :-1].transpose(1, 2), micro["labels"][:, 1:],
                              ignore_index=IGNORE, reduction="none").sum(1)  # fmt: skip
    return (per_row * micro["style"].mean(1)).sum(), (micro["labels"][:, 1:] != IGNORE).sum()


def test_a_per_row_tensor_as_wide_as_the_padding_is_refused_not_trimmed() -> None:
    batch = _styled(lm_batch(LENGTHS, ignore_frac=0.2))
    model = make_lm()
    s, n = _weighted(model, batch)
    want = flat_grad(model, s / n)
    keys = ("input_ids", "attention_mask", "labels", "style")  # the old behaviour: trimmed

    def body(win, micro):
        win.backward(*_weighted(model, micro))

    update, _ = one_step(model, [batch], body, micro_batch_tokens=24, token_keys=keys)
    assert rel(update, want) > 0.01  # trimmed features: wrong (7.9% on the Llama lab)
    model = make_lm()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    snap = Snapshot.take(model, opt)
    with fb.Accumulator(model, opt, micro_batch_tokens=24) as acc:
        with pytest.raises(ValueError, match=r"item\['style'\].*per token.*per row") as caught:
            next(iter(acc.windows([batch])))
    assert "token_keys=('attention_mask', 'input_ids', 'labels', 'style')" in str(caught.value)
    snap.assert_same(model, opt)
    # declared per row (left out of token_keys): follows its rows whole, exact and silent
    rows = ("input_ids", "attention_mask", "labels")
    model = make_lm()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        update, stats = one_step(model, [batch], body, micro_batch_tokens=24, token_keys=rows)
    assert stats.micro_batches > 2 and rel(update, want) < 1e-12


def test_known_token_keys_are_trimmed_silently_and_misaligned_ones_refused() -> None:
    batch = lm_batch(LENGTHS, ignore_frac=0.2)
    model = make_lm()
    want = full_batch_grad(model, batch)
    update, stats = _quiet_step(model, [batch], micro_batch_tokens=24)
    assert stats.micro_batches > 2 and rel(update, want) < 1e-12
    # labels with a real value past the rows' lengths (a decoder's labels?): not cut silently
    labels = batch["labels"].clone()
    labels[1, 6] = 5
    model = make_lm()
    with fb.Accumulator(model, torch.optim.SGD(model.parameters()), micro_batch_tokens=24) as acc:
        with pytest.raises(ValueError, match=r"item\['labels'\] holds values other than padding"):
            next(iter(acc.windows([{**batch, "labels": labels}])))


def test_token_keys_needs_a_splitting_that_trims() -> None:
    model = make_lm()
    with pytest.raises(ValueError, match=r"token_keys=.*micro_batch_tokens=T"):
        fb.Accumulator(model, torch.optim.SGD(model.parameters()), micro_batch_size=2,
                       token_keys=("input_ids",))  # fmt: skip
    with pytest.raises(ValueError, match="collection of key names"):
        fb.Accumulator(model, torch.optim.SGD(model.parameters()), micro_batch_tokens=8,
                       token_keys="input_ids")  # fmt: skip


def test_pack_refuses_an_unknown_key_as_wide_as_the_padding() -> None:
    batch = _styled(lm_batch(LENGTHS))
    model = make_lm()
    with fb.Accumulator(model, torch.optim.SGD(model.parameters()), micro_batch_tokens=24,
                        pack=True, verify_pack=False) as acc:  # fmt: skip
        with pytest.raises(ValueError, match=r"pack=True .* item\['style'\]"):
            next(iter(acc.windows([batch])))
    assert flat(model).isfinite().all()

"""Issue 26: mistakes made with the loss helpers and ``window.backward``.

Each mistake is first shown to train wrong (its first-step gradient against the plain full
batch, tiny Llama, float64, computed without fullbatch's checks), then made through fullbatch:
refused before anything changes, or, where no check can tell it from correct code, caught by
``fb.verify`` and documented. The nearest correct form says nothing and is exact.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import fullbatch as fb
from _mistake_cases import (
    IGNORE,
    cos,
    flat_grad,
    full_batch_grad,
    logits,
    loss,
    one_step,
    rel,
    tiny_llama,
    window,
)
from conftest import Snapshot

pytest.importorskip("transformers")

MICRO = 2


def _micro_batches(batch):
    rows = batch["input_ids"].shape[0]
    return [{k: v[i : i + MICRO] for k, v in batch.items()} for i in range(0, rows, MICRO)]


def _accumulated(model, batch, term) -> torch.Tensor:
    """What a correct accumulator makes of ``term(model, micro) -> (sum, count)``: the mistake's
    gradient, computed in plain PyTorch (``∇ Σ S'_k / Σ n'_k``)."""
    terms = [term(model, micro) for micro in _micro_batches(batch)]
    return flat_grad(model, sum(s for s, _ in terms) / sum(float(n) for _, n in terms))


def _refused(model, batch, body, error=ValueError, match=None, **options):
    """Run one window with the mistake in ``body``: it raises, nothing changed."""
    opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
    snap = Snapshot.take(model, opt)
    with fb.Accumulator(model, opt, **(options or {"micro_batch_size": MICRO})) as acc:
        with pytest.raises(error, match=match) as caught:
            for win in acc.windows([batch]):
                for micro in win:
                    body(win, micro)
                win.step()
    snap.assert_same(model, opt)
    assert all(p.grad is None for p in model.parameters()) and acc.steps == 0
    return str(caught.value)


def _exact(model, batch, body, tol: float = 1e-6, **options) -> fb.StepStats:
    """The correct form: silent (every warning an error) and the full batch's step."""
    want = full_batch_grad(model, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        update, stats = one_step(model, [batch], body, **(options or {"micro_batch_size": MICRO}))
    assert rel(update, want) < tol, rel(update, want)  # float64 Llama: 5e-8 band (rotary)
    return stats


# -- logits[:, :-1], labels[:, 1:] passed to fb.causal_lm_loss (shifted twice) -----------------


def _sliced_twice(model, micro):
    out = logits(model, micro)
    return fb.causal_lm_loss(out[:, :-1], micro["labels"][:, 1:])


def _copied_twice(model, micro):
    """The same mistake with copies: the views are gone, the count still tells."""
    out = logits(model, micro)
    return fb.causal_lm_loss(out[:, :-1].contiguous(), micro["labels"][:, 1:].contiguous())


def test_slices_passed_to_causal_lm_loss_train_wrong() -> None:
    model, batch = tiny_llama(), window()
    got = _accumulated(model, batch, _copied_twice)  # copies: no check on this path
    want = full_batch_grad(model, batch)
    assert rel(got, want) > 1.0 and cos(got, want) < 0.3  # 143%, cos 0.01 here


def test_slices_passed_to_causal_lm_loss_raise_with_the_fix() -> None:
    out = torch.randn(2, 6, 5, dtype=torch.float64)
    labels = torch.randint(0, 5, (2, 6))
    with pytest.raises(
        ValueError, match=r"already shifted.*fb\.cross_entropy_sum\(logits\[:, :-1\]"
    ):
        fb.causal_lm_loss(out[:, :-1], labels[:, 1:])
    with pytest.raises(ValueError, match="already shifted"):  # one row, a micro-batch's view
        fb.causal_lm_loss(out[1:][:, :-1], labels[1:][:, 1:])
    # through fullbatch: refused at the loss, before any backward
    model = tiny_llama()
    error = _refused(model, window(), lambda w, m: w.backward(*_sliced_twice(model, m)))
    assert "fb.causal_lm_loss(logits, labels)" in error


def test_copied_slices_are_caught_by_their_count() -> None:
    model = tiny_llama()
    error = _refused(model, window(), lambda w, m: w.backward(*_copied_twice(model, m)))
    assert "shifts these labels twice" in error and "fb.cross_entropy_sum" in error


def test_the_correct_shifts_stay_silent_and_exact() -> None:
    model, batch = tiny_llama(), window()

    def unshifted(win, micro):
        win.backward(*fb.causal_lm_loss(logits(model, micro), micro["labels"]))

    def own_shift(win, micro):  # sliced by hand, no second shift
        out = logits(model, micro)
        win.backward(*fb.cross_entropy_sum(out[:, :-1], micro["labels"][:, 1:]))

    _exact(model, batch, unshifted)
    _exact(model, batch, own_shift)
    # inputs that are a view at column 1 (a BOS column stripped) with their own labels: fine
    raw = torch.randint(3, 64, (2, 7))
    ids = raw[:, 1:]
    _, n = fb.causal_lm_loss(torch.randn(2, 6, 64), ids)
    assert int(n) == 10


# -- pad-id labels in a batch without attention_mask ------------------------------------------


def _no_mask(batch, pad_labels: bool = True):
    labels = batch["input_ids"].clone() if pad_labels else batch["labels"]
    return {"input_ids": batch["input_ids"], "labels": labels}


@pytest.mark.parametrize(("pad", "eos"), [(0, None), (None, 2)])
def test_pad_id_labels_without_a_mask_train_wrong_and_raise(pad, eos) -> None:
    """The pad id from model.config: pad_token_id, or the eos id a tokenizer pads with."""
    model = tiny_llama(pad_token_id=pad, eos_token_id=eos)
    batch = window(pad=2 if pad is None else pad)
    want = full_batch_grad(model, batch)
    got = _accumulated(model, _no_mask(batch), loss)
    assert rel(got, want) > 1.0 and cos(got, want) < 0.5  # 210%, cos 0.29 here
    error = _refused(model, _no_mask(batch), lambda w, m: w.backward(*loss(model, m)))
    assert "labels are counted on padding" in error
    assert "masked_fill(attention_mask == 0, -100)" in error


def test_labels_without_a_mask_that_are_not_padding_stay_silent() -> None:
    model = tiny_llama(pad_token_id=0, eos_token_id=2)
    batch = window()

    def body(win, micro):
        win.backward(*loss(model, micro))

    _exact(model, _no_mask(batch, pad_labels=False), body)  # -100 on padding, no mask
    # one end-of-sequence target after each row's text (eos 2), then padding labelled -100
    eos = batch["labels"].clone()
    ids = batch["input_ids"].clone()
    for row, n in enumerate(batch["attention_mask"].sum(1).tolist()):
        if n < ids.shape[1]:
            ids[row, n] = eos[row, n] = 2
    _exact(model, {"input_ids": ids, "labels": eos}, body)
    # text ending in a repeated token that is not the pad id, labelled
    text = window(lengths=[6, 6, 6, 6])
    text["input_ids"][:, -3:] = 7
    text["labels"] = text["input_ids"].clone()
    _exact(model, _no_mask(text, pad_labels=False), body)


def test_a_model_without_pad_ids_is_not_checked() -> None:
    """No config, no attention_mask: nothing tells padding from text (documented)."""
    model = tiny_llama(pad_token_id=None, eos_token_id=None)
    batch = _no_mask(window())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        one_step(model, [batch], lambda w, m: w.backward(*loss(model, m)), micro_batch_size=2)


# -- the same loss backpropagated twice -------------------------------------------------------


def test_the_same_loss_twice_trains_wrong() -> None:
    model, batch = tiny_llama(), window()
    want = full_batch_grad(model, batch)

    def doubled(model, micro):
        s, n = loss(model, micro)
        return 2 * s, n

    assert rel(_accumulated(model, batch, doubled), want) > 0.99


@pytest.mark.parametrize("where", ["every", "some", "view"])
def test_the_same_loss_twice_raises(where: str) -> None:
    model = tiny_llama()
    seen = []

    def body(win, micro):
        s, n = loss(model, micro)
        seen.append(micro)
        if where == "some" and len(seen) < 3:
            win.backward(s, n)
            return
        win.backward(s, n, retain_graph=True)
        win.backward(s.reshape(()) if where == "view" else s, 0)

    error = _refused(model, window(), body, match="same loss was passed to window.backward twice")
    assert "window.backward(aux_sum, 0)" in error


def test_a_second_term_sharing_the_graph_stays_allowed() -> None:
    model, batch = tiny_llama(), window()
    reg = 1e-3

    def body(win, micro):
        out = logits(model, micro)
        s, n = fb.causal_lm_loss(out, micro["labels"])
        win.backward(s, n, retain_graph=True)
        win.backward(reg * out.square().sum(), 0)  # another term over the same graph

    out = logits(model, batch)
    mean = torch.nn.functional.cross_entropy(
        out[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=IGNORE
    )
    n = int((batch["labels"][:, 1:] != IGNORE).sum())
    want = flat_grad(model, mean + reg * out.square().sum() / n)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        update, _ = one_step(model, [batch], body, micro_batch_size=MICRO)
    assert rel(update, want) < 1e-6


# -- share divided by the micro-batch's own count (silent by design: verify catches it) --------


COUNTS = {"tokens": lambda m: fb.count_tokens(m["labels"])}


def test_a_share_divided_by_its_own_count_trains_wrong_and_verify_catches_it() -> None:
    model, batch = tiny_llama(), window()
    want = full_batch_grad(model, batch)

    def own_count(win, micro):
        _ = win.totals  # read (for logging), yet not used
        s, n = loss(model, micro)
        win.backward(s / n)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # silent: a share has no unit
        update, _ = one_step(model, [batch], own_count, micro_batch_size=MICRO, counts=COUNTS)
    assert rel(update, want) > 2.0  # 301% here

    def share(model, micro, totals):
        return loss(model, micro)[0] / totals["tokens"]

    def own(model, micro, totals):
        s, n = loss(model, micro)
        return s / n

    assert fb.verify(model, batch, share, micro_batch_size=MICRO, counts=COUNTS).passed
    report = fb.verify(model, batch, own, micro_batch_size=MICRO, counts=COUNTS)
    assert not report.passed
    assert any("does not scale as 1 / window.totals" in line for line in report.diagnosis)


# -- a count in the wrong unit (silent by design: the unit is the user's) -----------------------


@pytest.mark.parametrize(
    ("unit", "factor"),
    [("rows", None), ("numel", None), ("total", 0.25), ("leftover", 0.25)],
)
def test_a_count_in_another_unit_only_rescales_the_step(unit: str, factor) -> None:
    """Documented, not detected: the same direction (cos 1), another length."""
    model, batch = tiny_llama(), window()
    want = full_batch_grad(model, batch)
    total = int((batch["labels"][:, 1:] != IGNORE).sum())

    def body(win, micro):
        s, n = loss(model, micro)
        count = {
            "rows": micro["input_ids"].shape[0],
            "numel": micro["input_ids"].numel(),
            "total": total,
            "leftover": n,
        }[unit]
        win.backward(s / 4 if unit == "leftover" else s, count)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        update, _ = one_step(model, [batch], body, micro_batch_size=MICRO)
    assert cos(update, want) > 1 - 1e-9
    ratio = float(update.norm() / want.norm())
    assert abs(ratio - 1) > 0.4
    if factor is not None:
        assert ratio == pytest.approx(factor, rel=1e-6)

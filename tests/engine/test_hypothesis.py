"""Property: for any split and any padding pattern, one fullbatch step is the full-batch step.

Hypothesis draws row lengths, which labels are ignored, the micro-batch size or the uneven
partition into K micro-batches, and float64 data; the update must equal the plain-PyTorch
full-batch gradient to 1e-10 relative.
"""

from __future__ import annotations

import itertools
import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import (
    IGNORE,
    PAD_ID,
    assert_close_rel,
    class_batch,
    full_batch_reference,
    make_lm,
    make_mlp,
    rel_err,
    sgd_update,
    split_uneven,
)

RTOL = 1e-10
VOCAB = 11

SETTINGS = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)


@st.composite
def lm_windows(draw):
    """A padded LM batch: lengths, per-token ignore flags, token ids; at least one counted."""
    rows = draw(st.integers(1, 9))
    lengths = draw(st.lists(st.integers(1, 12), min_size=rows, max_size=rows))
    if max(lengths) == 1:
        lengths[0] = 2  # some row must predict a token
    width = max(lengths) + draw(st.integers(0, 2))  # sometimes extra all-padding columns
    ids = torch.full((rows, width), PAD_ID, dtype=torch.long)
    labels = torch.full((rows, width), IGNORE, dtype=torch.long)
    mask = torch.zeros(rows, width, dtype=torch.long)
    for i, n in enumerate(lengths):
        tokens = draw(st.lists(st.integers(1, VOCAB - 1), min_size=n, max_size=n))
        ignored = draw(st.lists(st.booleans(), min_size=n, max_size=n))
        ids[i, :n] = torch.tensor(tokens)
        mask[i, :n] = 1
        kept = [IGNORE if z else t for t, z in zip(tokens, ignored, strict=True)]
        labels[i, :n] = torch.tensor(kept)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    # The full-batch reference needs at least one predicted token (otherwise mean = NaN).
    if int((labels[:, 1:] != IGNORE).sum()) == 0:
        r = draw(st.sampled_from([i for i, n in enumerate(lengths) if n >= 2]))
        labels[r, 1] = ids[r, 1]
    return batch


def partition(draw, rows: int) -> list[int]:
    k = draw(st.integers(1, rows))
    cuts = sorted(draw(st.sets(st.integers(1, rows - 1), min_size=k - 1, max_size=k - 1)))
    bounds = [0, *cuts, rows]
    return [b - a for a, b in itertools.pairwise(bounds)]


def check(model, batch, loader, **kwargs) -> None:
    ref = full_batch_reference(model, batch)
    update, stats = sgd_update(model, loader, **kwargs)
    assert rel_err(update, ref.grads) < RTOL
    assert stats.count == ref.count
    assert_close_rel(stats.loss, ref.loss, RTOL)
    assert_close_rel(stats.grad_norm, ref.grad_norm, RTOL)


@SETTINGS
@given(batch=lm_windows(), size=st.integers(1, 11), seed=st.integers(0, 3))
def test_lm_any_micro_batch_size(batch, size, seed) -> None:
    check(make_lm(seed, vocab=VOCAB), batch, [batch], micro_batch_size=size)


@SETTINGS
@given(data=st.data(), seed=st.integers(0, 3))
def test_lm_any_uneven_partition(data, seed) -> None:
    batch = data.draw(lm_windows())
    rows = batch["input_ids"].shape[0]
    sizes = partition(data.draw, rows) if rows > 1 else [1]
    trim_width = data.draw(st.booleans())
    micros = split_uneven(batch, sizes, trim_width=trim_width)
    check(make_lm(seed, vocab=VOCAB), batch, micros, micro_batches=len(sizes))


@SETTINGS
@given(
    rows=st.integers(1, 12),
    data=st.data(),
    size=st.integers(1, 14),
)
def test_mlp_ignored_samples(rows, data, size) -> None:
    ignored = data.draw(st.sets(st.integers(0, rows - 1), max_size=rows - 1))
    batch = class_batch(rows, seed=rows, ignore=sorted(ignored))
    check(make_mlp(), batch, [batch], micro_batch_size=size)


@SETTINGS
@given(
    n_micro=st.integers(1, 7),
    k=st.integers(1, 4),
    drop=st.booleans(),
    data=st.data(),
)
def test_stream_windows_each_normalized_by_own_count(n_micro, k, drop, data) -> None:
    """A stream of micro-batches cut into windows of K (the tail partial or dropped): every
    window's update equals its own full-batch gradient (SGD lr=1 from the current point)."""
    from test_exactness import fullbatch_trajectory, reference_trajectory

    micros = []
    for _ in range(n_micro):
        rows = data.draw(st.integers(1, 3))
        ignored = data.draw(st.sets(st.integers(0, rows - 1), max_size=rows - 1))
        micros.append(class_batch(rows, seed=len(micros), ignore=sorted(ignored)))
    starts = range(0, n_micro - (k - 1 if drop else 0), k)
    windows = [
        {key: torch.cat([m[key] for m in micros[s : s + k]]) for key in micros[0]} for s in starts
    ]
    model = make_mlp()

    def sgd(m):
        return torch.optim.SGD(m.parameters(), lr=1.0)

    ref = reference_trajectory(model, windows, sgd)
    stats, snaps = fullbatch_trajectory(
        model, iter(micros), sgd, micro_batches=k, partial_window="drop" if drop else "step"
    )
    assert len(stats) == len(ref) == (n_micro // k if drop else math.ceil(n_micro / k))
    for s, p, r in zip(stats, snaps, ref, strict=True):
        assert_close_rel(s.loss, r["loss"], RTOL)
        assert rel_err(p, r["params"]) < RTOL


@SETTINGS
@given(data=st.data(), weight=st.floats(0.0, 2.0))
def test_two_terms_shares_any_partition(data, weight) -> None:
    """Up-front form: token CE over window.totals["tokens"] plus a per-row term over
    window.totals["rows"], two backward calls per micro-batch, any uneven partition."""
    from test_exactness import aux_row_sum, two_term_objective

    import fullbatch as fb

    batch = data.draw(lm_windows())
    rows = batch["input_ids"].shape[0]
    sizes = partition(data.draw, rows) if rows > 1 else [1]
    model = make_lm(0, vocab=VOCAB)
    ref = full_batch_reference(model, batch, two_term_objective(weight))
    counts = {
        "tokens": lambda m: fb.count_tokens(m["labels"]),
        "rows": lambda m: m["input_ids"].shape[0],
    }

    def shares(m, micro, totals):
        logits = m(micro["input_ids"])
        ce_sum, _ = fb.causal_lm_loss(logits, micro["labels"])
        return ce_sum / totals["tokens"], weight * aux_row_sum(logits) / totals["rows"]

    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with fb.Accumulator(model, opt, micro_batches=len(sizes), counts=counts) as acc:
        for window in acc.windows(split_uneven(batch, sizes)):
            for micro in window:
                first, second = shares(model, micro, window.totals)
                window.backward(first, retain_graph=True)
                window.backward(second)
            stats = window.step()
    update = [b - a.detach() for b, a in zip(before, model.parameters(), strict=True)]
    assert rel_err(update, ref.grads) < RTOL
    assert_close_rel(stats.loss, ref.loss, RTOL)

"""Length-aware micro-batches (``micro_batch_tokens``, ``sort_rows``, ``lengths``): one step in
float64 equals the plain full-batch step, and the padding really goes away."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import fullbatch as fb
from conftest import (
    IGNORE,
    PAD_ID,
    fb_loss,
    full_batch_reference,
    lm_batch,
    make_lm,
    make_mlp,
    rel_err,
    sgd_update,
)
from fullbatch._base._sort_trim import SortTrim

LENGTHS = [3, 11, 1, 7, 2, 9, 5, 6, 4, 10]  # 10 rows, longest 11
WIDTH = 16  # padded wider than the longest row


def window(seed: int = 0, lengths: list[int] = LENGTHS, width: int = WIDTH) -> dict:
    return lm_batch(lengths, seed=seed, width=width, ignore_frac=0.2)


def check_exact(batch: dict, tol: float = 1e-10, **options: object) -> fb.StepStats:
    model = make_lm()
    ref = full_batch_reference(model, batch)
    grads, stats = sgd_update(model, [batch], **options)
    assert rel_err(grads, ref.grads) < tol, rel_err(grads, ref.grads)
    assert stats.count == ref.count
    assert stats.loss == pytest.approx(ref.loss, rel=tol)
    return stats


def micro_batches_of(batch: object, **options: object) -> list:
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with fb.Accumulator(model, opt, **options) as acc:
        window = next(iter(acc.windows([batch])))
        micros = list(window)
        window.discard()
    return micros


# -- exactness -------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", [1, 11, 16, 20, 33, 50, 80, 160, 1000])
def test_token_budget_one_step_equals_full_batch(tokens: int) -> None:
    """From one row per micro-batch (every row over budget) to the whole window in one."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rows longer than small budgets: tested below
        stats = check_exact(window(), micro_batch_tokens=tokens)
    assert stats.micro_batches >= 1


@pytest.mark.parametrize("size", range(1, 11))
def test_sort_rows_every_size_equals_full_batch(size: int) -> None:
    stats = check_exact(window(seed=size), micro_batch_size=size, sort_rows=True)
    assert stats.micro_batches == -(-10 // size)


def test_token_budget_bounds_padded_tokens_and_trims() -> None:
    batch = window()
    micros = micro_batches_of(batch, micro_batch_tokens=20)
    computed = 0
    for m in micros:
        rows, width = m["input_ids"].shape
        assert rows * width <= 20
        assert width == int(m["attention_mask"].sum(1).max())  # trimmed to its longest row
        assert m["labels"].shape == m["attention_mask"].shape == (rows, width)
        computed += rows * width
    assert sum(m["input_ids"].shape[0] for m in micros) == 10
    real = sum(LENGTHS)
    # the window computes 10 x 16 = 160 positions; sorted and trimmed, barely more than real
    assert real <= computed < 0.6 * batch["input_ids"].numel()
    # every row arrives exactly once
    got = sorted(tuple(r.tolist()) for m in micros for r in m["input_ids"])
    want = sorted(tuple(r[: max(LENGTHS)].tolist()) for r in batch["input_ids"])
    assert [tuple(x for x in g if x) for g in got] == [tuple(x for x in w if x) for w in want]


def test_sort_rows_trims_and_orders_longest_first() -> None:
    micros = micro_batches_of(window(), micro_batch_size=4, sort_rows=True)
    widths = [m["input_ids"].shape[1] for m in micros]
    assert widths == [11, 6, 2]  # sorted lengths 11 10 9 7 | 6 5 4 3 | 2 1
    assert [m["input_ids"].shape[0] for m in micros] == [4, 4, 2]


def test_row_longer_than_budget_is_alone_and_warned_once() -> None:
    lengths = [3, 14, 2, 13, 4]
    batch = window(lengths=lengths)
    with pytest.warns(UserWarning, match="longer than micro_batch_tokens=12") as caught:
        check_exact(batch, micro_batch_tokens=12)
    assert sum("longer than" in str(w.message) for w in caught) == 1
    with pytest.warns(UserWarning, match="a micro-batch of its own"):
        micros = micro_batches_of(batch, micro_batch_tokens=12)
    assert [tuple(m["input_ids"].shape) for m in micros] == [(1, 14), (1, 13), (3, 4)]


def test_warned_once_per_accumulator_over_windows() -> None:
    batches = [window(seed=s) for s in range(3)]
    model = make_lm()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fb.Accumulator(model, opt, micro_batch_tokens=5) as acc:
            for w in acc.windows(batches):
                for micro in w:
                    w.backward(*fb_loss(model, micro))
                w.step()
    assert sum("longer than" in str(c.message) for c in caught) == 1


def left_padded(lengths: list[int], width: int, seed: int = 0) -> dict:
    right = lm_batch(lengths, seed=seed, width=width)
    out = {}
    for key, value in right.items():
        rows = []
        for row, n in zip(value, lengths, strict=True):
            rows.append(torch.cat([row[n:], row[:n]]))  # the padding moves to the left
        out[key] = torch.stack(rows)
    return out


def test_left_padding_stays_exact_untrimmed_and_warns() -> None:
    batch = left_padded(LENGTHS, WIDTH)
    assert batch["attention_mask"][0, 0] == 0 and batch["attention_mask"][0, -1] == 1
    with pytest.warns(UserWarning, match="not right-padded") as caught:
        check_exact(batch, micro_batch_tokens=40)
    assert sum("right-padded" in str(w.message) for w in caught) == 1
    with pytest.warns(UserWarning, match="padding_side"):
        micros = micro_batches_of(batch, micro_batch_tokens=40)
    assert all(m["input_ids"].shape[1] == WIDTH for m in micros)  # not trimmed
    assert all(m["input_ids"].numel() <= 40 for m in micros)  # budget on the full width
    with pytest.warns(UserWarning, match="not right-padded"):
        check_exact(batch, micro_batch_size=3, sort_rows=True)


def test_non_sequence_leaves_follow_their_rows() -> None:
    """A per-row weight vector, a 0-dim tensor and a string reach the right micro-batches."""
    batch = window()
    batch["weight"] = torch.linspace(0.5, 2.0, 10, dtype=torch.float64)
    batch["scale"] = torch.tensor(3.0, dtype=torch.float64)
    batch["source"] = "stdlib"
    batch["row_id"] = torch.arange(10)

    def per_row(model, b):
        logits = model(b["input_ids"])
        tok = F.cross_entropy(
            logits[:, :-1].transpose(1, 2),
            b["labels"][:, 1:],
            ignore_index=IGNORE,
            reduction="none",
        )
        n = (b["labels"][:, 1:] != IGNORE).sum(1)
        return tok.sum(1) * b["weight"] * b["scale"], n * b["weight"]

    def weighted(model, b):
        assert b["source"] == "stdlib"
        want = torch.linspace(0.5, 2.0, 10, dtype=torch.float64)[b["row_id"]]
        assert torch.equal(b["weight"], want)
        losses, counts = per_row(model, b)
        return losses.sum(), counts.sum()

    model = make_lm()
    ref = full_batch_reference(model, batch, lambda m, b: weighted(m, b)[0] / weighted(m, b)[1])
    grads, stats = sgd_update(model, [batch], micro_batch_tokens=24, loss=weighted)
    assert stats.micro_batches > 2
    assert rel_err(grads, ref.grads) < 1e-10


def test_lengths_key_and_callable() -> None:
    batch = window()
    mask = batch.pop("attention_mask")
    batch["keep"] = mask.bool()
    check_exact(batch, micro_batch_tokens=30, lengths="keep")
    batch = window()
    del batch["attention_mask"]
    batch["n"] = torch.tensor(LENGTHS)
    check_exact(batch, micro_batch_tokens=30, lengths="n")  # a 1-D key: the lengths
    check_exact(batch, micro_batch_size=3, sort_rows=True, lengths=lambda b: b["n"])
    micros = micro_batches_of(batch, micro_batch_tokens=30, lengths=lambda b: b["n"])
    for m in micros:
        assert m["input_ids"].shape[1] == int(m["n"].max())
        assert m["input_ids"].numel() <= 30


def test_hf_llama_float64_rows_sorted_and_trimmed() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=17,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=WIDTH,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).double()
    batch = window()
    ref = full_batch_reference(model, batch)
    grads, _ = sgd_update(model, [batch], micro_batch_tokens=24)
    # Llama's RMSNorm computes in float32: float32's band, not float64's
    assert rel_err(grads, ref.grads) < 1e-6


# -- misuse ----------------------------------------------------------------------------------


def test_missing_lengths_key_names_the_fix() -> None:
    batch = {"input_ids": torch.ones(3, 4, dtype=torch.long), "labels": torch.ones(3, 4)}
    with pytest.raises(ValueError, match=r"'attention_mask' is absent.*lengths="):
        micro_batches_of(batch, micro_batch_tokens=8)
    with pytest.raises(ValueError, match="lengths="):
        micro_batches_of((batch["input_ids"],), micro_batch_size=2, sort_rows=True)


@pytest.mark.parametrize(
    "bad",
    [
        lambda b: [1, 2, 3],
        lambda b: torch.tensor([1.0, 2.0, 3.0]),
        lambda b: torch.tensor([1, 2]),
        lambda b: torch.tensor([1, 2, 9]),
        lambda b: torch.tensor([[1, 2, 3]]),
        lambda b: torch.tensor([True, False, True]),
    ],
)
def test_bad_lengths_callable(bad) -> None:
    batch = {"input_ids": torch.ones(3, 4, dtype=torch.long)}
    with pytest.raises(ValueError, match="lengths= callable"):
        micro_batches_of(batch, micro_batch_tokens=8, lengths=bad)


def test_bad_mask_shape() -> None:
    batch = {"input_ids": torch.ones(3, 4, dtype=torch.long), "attention_mask": torch.ones(3, 4, 2)}
    with pytest.raises(ValueError, match=r"shape \(3, 4, 2\)"):
        micro_batches_of(batch, micro_batch_tokens=8)


@pytest.mark.parametrize(
    "options,error,match",
    [
        ({"micro_batch_tokens": 0}, ValueError, "micro_batch_tokens must be an integer >= 1"),
        ({"micro_batch_tokens": -5}, ValueError, "got -5"),
        ({"micro_batch_tokens": 2.5}, ValueError, "got 2.5"),
        ({"micro_batch_tokens": True}, ValueError, "got True"),
        ({"micro_batch_tokens": 8, "micro_batch_size": 2}, ValueError, "exactly one"),
        ({"micro_batch_tokens": 8, "micro_batches": 2}, ValueError, "exactly one"),
        ({"micro_batches": 2, "sort_rows": True}, ValueError, "sort_rows=True.*micro_batch_size"),
        ({"micro_batch_tokens": 8, "sort_rows": True}, ValueError, "micro_batch_size"),
        ({"micro_batch_size": 2, "sort_rows": 1}, ValueError, "sort_rows must be True or False"),
        ({"micro_batch_size": 2, "lengths": "mask"}, ValueError, "micro_batch_tokens=T, or"),
        ({"micro_batches": 2, "lengths": len}, ValueError, "sort_rows=True"),
        ({"micro_batch_tokens": 8, "lengths": 3}, ValueError, "key of the loader item"),
        (
            {"micro_batch_tokens": 8, "partial_window": "drop"},
            ValueError,
            "partial_window='drop'",
        ),
    ],
)
def test_bad_options_are_refused(options: dict, error: type, match: str) -> None:
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(error, match=match):
        fb.Accumulator(model, opt, **options)


def test_sort_trim_direct_and_empty() -> None:
    assert SortTrim(micro_batch_tokens=4)({"attention_mask": torch.zeros(0, 3)}) == []
    with pytest.raises(ValueError, match="exactly one"):
        SortTrim()
    all_pad = {"attention_mask": torch.zeros(2, 3, dtype=torch.long), "x": torch.ones(2, 3)}
    micros = SortTrim(micro_batch_tokens=4, token_keys=("x",))(all_pad)
    assert [tuple(m["x"].shape) for m in micros] == [(2, 1)]  # never narrower than 1
    assert PAD_ID == 0


# -- properties ------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    lengths=st.lists(st.integers(0, 12), min_size=1, max_size=12),
    extra=st.integers(0, 4),
    tokens=st.integers(1, 60),
    size=st.integers(1, 13),
)
def test_packer_properties(lengths: list[int], extra: int, tokens: int, size: int) -> None:
    """Every row exactly once, each micro-batch trimmed to its longest row, budgets kept."""
    width = max(max(lengths), 1) + extra
    mask = (torch.arange(width) < torch.tensor(lengths)[:, None]).long()
    item = {"attention_mask": mask, "row": torch.arange(len(lengths)), "tag": "t"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        by_tokens = SortTrim(micro_batch_tokens=tokens)(item)
    by_rows = SortTrim(micro_batch_size=size)(item)
    for micros in (by_tokens, by_rows):
        assert sorted(int(r) for m in micros for r in m["row"]) == list(range(len(lengths)))
        for m in micros:
            assert m["tag"] == "t"
            assert torch.equal(m["attention_mask"].sum(1), mask[m["row"]].sum(1))
            assert m["attention_mask"].shape[1] == max(int(m["attention_mask"].sum(1).max()), 1)
    for m in by_tokens:
        rows, w = m["attention_mask"].shape
        assert rows * w <= tokens or rows == 1
    assert all(m["row"].shape[0] == size for m in by_rows[:-1])
    longest = [int(m["attention_mask"].sum(1).max()) for m in by_tokens]
    assert longest == sorted(longest, reverse=True)


def test_contract_names_are_keyword_only_with_their_defaults() -> None:
    import inspect

    sig = inspect.signature(fb.Accumulator).parameters
    defaults = {"micro_batch_tokens": None, "sort_rows": False, "lengths": "attention_mask"}
    for name, default in defaults.items():
        assert sig[name].kind is inspect.Parameter.KEYWORD_ONLY, name
        assert sig[name].default == default, name

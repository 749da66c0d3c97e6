"""``pad_to_multiple_of``: micro-batch widths on a grid, each step still the full batch.

Float64 steps against the plain full-batch reference in every bucketed mode (token budgets,
``sort_rows``, ``"auto"``, ``pack=True``, a transformers Llama); the padding past the window's
width (labels -100, masks 0, other keys the window's own padding value); budgets kept with the
rounded width; bad values refused before anything changes. DDP/FSDP2 on 2 gloo ranks:
``tests/distributed/test_distributed_sort_trim.py``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fullbatch as fb
from _auto_cases import TokenLM
from conftest import (
    IGNORE,
    Snapshot,
    full_batch_reference,
    lm_batch,
    make_lm,
    make_mlp,
    rel_err,
    sgd_update,
)
from fullbatch._base._packed import RowPacker
from fullbatch._base._sort_trim import SortTrim
from fullbatch._engine._micro_plan import ACCELERATOR_MULTIPLE, MicroBatchPlan

LENGTHS = [3, 11, 1, 7, 2, 9, 5, 6, 4, 10]  # 10 rows, longest 11
WIDTH = 13  # the window's padded width: a multiple of 8 or 64 lies past it


def window(seed: int = 0, lengths: list[int] = LENGTHS, width: int = WIDTH) -> dict:
    return lm_batch(lengths, seed=seed, width=width, ignore_frac=0.2)


def check_exact(batch: dict, tol: float = 1e-10, **options: object) -> fb.StepStats:
    model = make_lm()
    ref = full_batch_reference(model, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rows over small budgets
        grads, stats = sgd_update(model, [batch], **options)
    assert rel_err(grads, ref.grads) < tol, rel_err(grads, ref.grads)
    assert stats.count == ref.count  # the padding added counts nothing
    assert stats.loss == pytest.approx(ref.loss, rel=tol)
    return stats


def micro_batches_of(batch: dict, **options: object) -> list[dict]:
    model = make_lm()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with fb.Accumulator(model, opt, **options) as acc:
            win = next(iter(acc.windows([batch])))
            micros = list(win)
            win.discard()
    return micros


# -- exactness, float64 ------------------------------------------------------------------------


@pytest.mark.parametrize("multiple", [1, 3, 8, 64])
@pytest.mark.parametrize("tokens", [11, 24, 64, 200])
def test_token_budget_rounded_equals_full_batch(tokens: int, multiple: int) -> None:
    if tokens < multiple:
        pytest.skip("refused: a budget below the multiple (tested below)")
    micros = micro_batches_of(window(seed=tokens), micro_batch_tokens=tokens,
                              pad_to_multiple_of=multiple)  # fmt: skip
    for m in micros:
        rows, width = m["input_ids"].shape
        assert width % multiple == 0 or width == tokens  # never rounded past the budget
        assert rows * width <= tokens or rows == 1
    check_exact(window(seed=tokens), micro_batch_tokens=tokens, pad_to_multiple_of=multiple)


@pytest.mark.parametrize("multiple", [2, 8, 64])
@pytest.mark.parametrize("size", [1, 3, 4, 10])
def test_sort_rows_rounded_equals_full_batch(size: int, multiple: int) -> None:
    micros = micro_batches_of(window(seed=size), micro_batch_size=size, sort_rows=True,
                              pad_to_multiple_of=multiple)  # fmt: skip
    assert all(m["input_ids"].shape[1] % multiple == 0 for m in micros)
    assert [len(m["input_ids"]) for m in micros[:-1]] == [size] * (len(micros) - 1)
    stats = check_exact(window(seed=size), micro_batch_size=size, sort_rows=True,
                        pad_to_multiple_of=multiple)  # fmt: skip
    assert stats.micro_batches == -(-10 // size)


@pytest.mark.parametrize("tokens", [8, 20, 1000])
def test_packed_rows_rounded_equal_full_batch(tokens: int) -> None:
    batch = lm_batch([*LENGTHS, 0], seed=tokens, width=WIDTH, ignore_frac=0.2)
    micros = micro_batches_of(batch, micro_batch_tokens=tokens, pack=True, pad_to_multiple_of=4)
    for m in micros:
        n = m["input_ids"].shape[1]
        cu = m["cu_seq_lens_q"]
        assert (n % 4 == 0 or n == tokens) and int(cu[-1]) == n
        assert n <= tokens or len(cu) <= 3  # one row, and maybe its padding sequence
        assert m["max_length_q"] == int((cu[1:] - cu[:-1]).max())
    check_exact(batch, micro_batch_tokens=tokens, pack=True, pad_to_multiple_of=4)


@pytest.mark.parametrize("size", ["micro_batch_tokens", "micro_batch_size"])
def test_auto_sizes_rounded_equal_the_full_batch(size: str) -> None:
    batch = lm_batch([9, 3, 12, 5, 7, 2, 11, 4], seed=1, width=13)
    model = TokenLM(tokens=40).double()  # out of memory above 40 padded tokens
    ref = full_batch_reference(TokenLM(tokens=10**6).double(), batch, _token_lm_mean)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    extra = {"sort_rows": True} if size == "micro_batch_size" else {}
    with fb.Accumulator(model, opt, pad_to_multiple_of=8, **{size: "auto"}, **extra) as acc:
        for win in acc.windows([batch]):
            stats = win.run(lambda m: fb.causal_lm_loss(model(m["input_ids"]), m["labels"]))
    assert stats.retries >= 1 and stats.count == ref.count
    grads = [b - p.detach() for b, p in zip(before, model.parameters(), strict=True)]
    assert rel_err(grads, ref.grads) < 1e-10


def _token_lm_mean(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    loss_sum, n = fb.causal_lm_loss(model(batch["input_ids"]), batch["labels"])
    return loss_sum / n


def test_hf_llama_rounded_past_the_window_equals_full_batch() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=17, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).double()
    batch = window()
    ref = full_batch_reference(model, batch)
    for options in ({"micro_batch_tokens": 48}, {"micro_batch_size": 3, "sort_rows": True}):
        fresh = transformers.LlamaForCausalLM(config).double()
        fresh.load_state_dict(model.state_dict())
        grads, stats = sgd_update(fresh, [batch], pad_to_multiple_of=16, **options)
        assert stats.count == ref.count
        assert rel_err(grads, ref.grads) < 1e-6  # Llama's RMSNorm computes in float32


# -- the padding past the window ---------------------------------------------------------------


def test_padding_past_the_window_is_each_keys_own() -> None:
    """labels -100, the mask 0, input_ids the window's own pad value (EOS then PAD here),
    per-row tensors untouched, the real columns as they were."""
    eos, pad = 2, 9
    batch = lm_batch([5, 3, 4], seed=0, width=6)
    mask = batch["attention_mask"]
    ids = batch["input_ids"].masked_fill(mask == 0, pad)
    for r, n in enumerate([5, 3, 4]):
        ids[r, n] = eos  # an end-of-sequence token on the first padding position
    batch["input_ids"] = ids
    batch["row"] = torch.arange(3)
    [micro] = micro_batches_of(batch, micro_batch_size=3, sort_rows=True, pad_to_multiple_of=8)
    assert micro["input_ids"].shape == (3, 8) and micro["row"].tolist() == [0, 2, 1]
    order = [0, 2, 1]
    assert torch.equal(micro["input_ids"][:, :6], ids[order])
    assert torch.equal(micro["labels"][:, :6], batch["labels"][order])
    assert (micro["input_ids"][:, 6:] == pad).all()
    assert (micro["labels"][:, 6:] == IGNORE).all()
    assert (micro["attention_mask"][:, 6:] == 0).all()


def test_a_window_without_padding_keeps_its_width() -> None:
    """Every row fills the window: no padding value to copy, so no column is invented."""
    batch = lm_batch([6, 6, 6], seed=0, width=6)
    micros = micro_batches_of(batch, micro_batch_tokens=12, pad_to_multiple_of=8)
    assert [tuple(m["input_ids"].shape) for m in micros] == [(2, 6), (1, 6)]
    check_exact(batch, micro_batch_tokens=12, pad_to_multiple_of=8)


def test_left_padding_is_neither_trimmed_nor_rounded() -> None:
    batch = lm_batch([5, 3, 4], seed=0, width=6)
    batch = {k: v.flip(1) for k, v in batch.items()}  # left padding
    micros = micro_batches_of(batch, micro_batch_size=2, sort_rows=True, pad_to_multiple_of=8)
    assert all(m["input_ids"].shape[1] == 6 for m in micros)


def test_padding_is_read_on_the_device_without_a_host_read() -> None:
    """The window's own padding value is a view of the window, never a Python number."""
    batch = window()
    micros = SortTrim(micro_batch_size=10, pad_to_multiple_of=16)(batch)
    assert micros[0]["input_ids"].shape == (10, 16)
    packed = RowPacker(micro_batch_tokens=16, pad_to_multiple_of=16)(batch)
    assert all(m["input_ids"].shape[1] == 16 for m in packed)


# -- budgets and the grid ----------------------------------------------------------------------


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    lengths=st.lists(st.integers(0, 30), min_size=1, max_size=14),
    extra=st.integers(0, 5),
    tokens=st.integers(8, 120),
    multiple=st.sampled_from([1, 2, 4, 8, 16]),
)
def test_every_row_once_widths_on_the_grid_budget_kept(
    lengths: list[int], extra: int, tokens: int, multiple: int
) -> None:
    width = max(max(lengths), 1) + extra
    mask = (torch.arange(width) < torch.tensor(lengths)[:, None]).long()
    item = {"attention_mask": mask, "input_ids": mask * 3, "row": torch.arange(len(lengths))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        micros = SortTrim(micro_batch_tokens=tokens, pad_to_multiple_of=multiple)(item)
    assert sorted(int(r) for m in micros for r in m["row"]) == list(range(len(lengths)))
    padded = any(n < width for n in lengths)
    for m in micros:
        rows, w = m["input_ids"].shape
        real = int(m["attention_mask"].sum(1).max())
        assert torch.equal(m["attention_mask"].sum(1), mask[m["row"]].sum(1))
        assert w % multiple == 0 or w == tokens or (not padded and w == width)
        assert w - max(real, 1) < multiple or (not padded and w == width)
        assert rows * w <= tokens or (rows == 1 and real > tokens)  # the budget, rounded too


# -- refused before anything changes ------------------------------------------------------------


@pytest.mark.parametrize(
    "options,match",
    [
        ({"micro_batch_tokens": 64, "pad_to_multiple_of": 0}, "pad_to_multiple_of must be"),
        ({"micro_batch_tokens": 64, "pad_to_multiple_of": -8}, "got -8"),
        ({"micro_batch_tokens": 64, "pad_to_multiple_of": 8.0}, "got 8.0"),
        ({"micro_batch_tokens": 64, "pad_to_multiple_of": True}, "got True"),
        ({"micro_batch_tokens": 64, "pad_to_multiple_of": "64"}, "got '64'"),
        ({"micro_batch_size": 4, "pad_to_multiple_of": 8}, "pad_to_multiple_of=8 rounds"),
        ({"micro_batches": 4, "pad_to_multiple_of": 8}, "sort_rows=True"),
        ({"micro_batch_tokens": 32, "pad_to_multiple_of": 64}, "larger than micro_batch_tokens"),
    ],
)
def test_bad_values_are_refused_naming_the_option(options: dict, match: str) -> None:
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = Snapshot.take(model, opt)
    with pytest.raises(ValueError, match=match) as caught:
        fb.Accumulator(model, opt, **options)
    assert "pad_to_multiple_of" in str(caught.value)
    before.assert_same(model, opt)
    assert not opt._optimizer_step_pre_hooks  # no hook left behind
    fb.Accumulator(model, opt, micro_batch_tokens=64).close()  # still usable


def test_none_is_exact_on_a_cpu_and_64_on_an_accelerator() -> None:
    assert MicroBatchPlan(micro_batch_tokens=64).pad_to_multiple_of is None
    on_gpu = MicroBatchPlan(micro_batch_tokens=64, accelerator=True)
    assert on_gpu.pad_to_multiple_of == ACCELERATOR_MULTIPLE == 64
    auto = MicroBatchPlan(micro_batch_tokens="auto", accelerator=True)
    assert auto.pad_to_multiple_of == 64
    # a budget below the multiple: every micro-batch would be one row; exact widths instead
    assert MicroBatchPlan(micro_batch_tokens=48, accelerator=True).pad_to_multiple_of is None
    assert MicroBatchPlan(micro_batch_size=4, sort_rows=True, accelerator=True).mode == (
        "micro_batch_size, sort_rows, pad_to_multiple_of=64"
    )
    # nothing is trimmed without sorting: nothing to round, nothing refused
    assert MicroBatchPlan(micro_batch_size=4, accelerator=True).pad_to_multiple_of is None
    exact = MicroBatchPlan(micro_batch_tokens=64, pad_to_multiple_of=1, accelerator=True)
    assert exact.pad_to_multiple_of == 1
    micros = micro_batches_of(window(), micro_batch_tokens=64)  # a CPU model: exact widths
    assert all(m["input_ids"].shape[1] == int(m["attention_mask"].sum(1).max()) for m in micros)


def test_resuming_inside_a_window_with_another_multiple_is_refused() -> None:
    model = make_lm()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with fb.Accumulator(model, opt, micro_batch_tokens=24, pad_to_multiple_of=8) as acc:
        win = next(iter(acc.windows([window()])))
        micro = next(iter(win))
        win.backward(*fb.causal_lm_loss(model(micro["input_ids"]), micro["labels"]))
        state = acc.state_dict()
        win.discard()
    again = make_lm()
    other = fb.Accumulator(again, torch.optim.SGD(again.parameters()), micro_batch_tokens=24)
    with pytest.raises(ValueError, match="pad_to_multiple_of=8, but this Accumulator has"):
        other.load_state_dict(state)

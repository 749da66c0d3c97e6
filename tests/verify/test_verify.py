"""``fb.verify`` and ``fb.testing.assert_equivalent`` against a plain full-batch reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fullbatch as fb
from fullbatch._verify._arms import compare
from fullbatch._verify._run import verify
from fullbatch.testing import assert_equivalent


def _mlp(dtype: torch.dtype = torch.float64, *, dropout: float = 0.0, bn: bool = False):
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(5, 16)]
    layers += [nn.BatchNorm1d(16)] if bn else []
    layers += [nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 4)]
    return nn.Sequential(*layers).to(dtype)


def _classification(rows: int = 8, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    labels = torch.randint(0, 4, (rows,), generator=gen)
    labels[1] = -100  # micro-batches count different numbers of items
    return {"x": torch.randn(rows, 5, generator=gen, dtype=dtype), "y": labels}


def _sum_loss(model: nn.Module, micro: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return fb.cross_entropy_sum(model(micro["x"]), micro["y"])


def _mean_loss(model: nn.Module, micro: dict) -> tuple[torch.Tensor, torch.Tensor]:
    loss = nn.functional.cross_entropy(model(micro["x"]), micro["y"])  # mean over items
    return loss, (micro["y"] != -100).sum()


def _naive_loss(model: nn.Module, micro: dict) -> tuple[torch.Tensor, int]:
    # the `loss / K` recipe: a per-micro-batch mean that counts as one item
    return nn.functional.cross_entropy(model(micro["x"]), micro["y"]), 1


def _in_batch_negatives(model: nn.Module, micro: dict) -> tuple[torch.Tensor, int]:
    z = model(micro["x"])
    logits = z @ z.T  # every row scored against every other row of its batch
    return fb.cross_entropy_sum(logits, torch.arange(len(z)))


def _tiny_llama(**overrides):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        **overrides,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).train()


def _padded_tokens(lengths=(9, 3, 6, 2, 8, 5)) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, :length] = torch.randint(1, 64, (length,), generator=gen)
        labels[row, :length] = ids[row, :length]
        mask[row, :length] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _lm_loss(model: nn.Module, micro: dict) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"]).logits
    return fb.causal_lm_loss(logits, micro["labels"])


def test_correct_recipe_passes_in_float64() -> None:
    report = verify(_mlp(), _classification(), _sum_loss, micro_batch_size=3)
    assert report.passed, report
    assert report.diagnosis == []
    assert report.tolerance == 1e-10 and report.dtype == "float64"
    assert report.micro_batches == 3 and report.rows == 8 and report.count == 7
    assert report.fullbatch.max_rel_error < 1e-12
    assert report.naive.max_rel_error > 1e-3  # uneven counts: the naive recipe is off
    assert report.additivity is not None and report.additivity.holds
    text = str(report)
    assert text.startswith("fullbatch verify: PASSED (float64, tolerance 1e-10")
    for part in ("fullbatch", "naive (loss / K)", "additivity ok", "randomness: none"):
        assert part in text


def test_tiny_llama_with_padded_rows_passes_in_float32() -> None:
    model = _tiny_llama()
    report = verify(model, _padded_tokens(), _lm_loss, micro_batch_size=2)
    assert report.passed, report
    assert report.tolerance == 1e-5 and report.dtype == "float32"
    assert report.fullbatch.max_rel_error < 1e-5
    assert report.naive.max_rel_error > 1e-3


@pytest.mark.parametrize(
    ("loss_fn", "cause"),
    [
        (_mean_loss, "mean-reduced loss"),
        (_naive_loss, "constant count"),
        (_in_batch_negatives, "coupled loss"),
    ],
)
def test_non_additive_losses_fail_with_their_cause(loss_fn, cause: str) -> None:
    report = verify(_mlp(), _classification(), loss_fn, micro_batch_size=3)
    assert not report.passed
    assert report.additivity is not None and not report.additivity.holds
    assert report.diagnosis[0].startswith("fullbatch differs from the full batch")
    assert report.diagnosis[1].startswith(cause), report.diagnosis
    assert len(report.diagnosis) == 2
    assert cause in str(report)
    if cause == "coupled loss":  # the diagnosis names the mode that makes it exact
        assert "window.run_coupled(encode, loss)" in report.diagnosis[1]


def test_mean_with_row_count_is_diagnosed_as_mean() -> None:
    def token_mean_row_count(model, micro):
        loss = nn.functional.cross_entropy(model(micro["x"]), micro["y"])
        return loss, len(micro["y"])

    report = verify(_mlp(), _classification(), token_mean_row_count, micro_batch_size=3)
    assert report.diagnosis[1].startswith("mean-reduced loss"), report.diagnosis


def test_train_mode_batchnorm_fails_with_its_cause() -> None:
    report = verify(_mlp(bn=True), _classification(), _sum_loss, micro_batch_size=4)
    assert not report.passed
    assert report.diagnosis[1].startswith("train-mode BatchNorm (modules '1')"), report.diagnosis
    assert len(report.diagnosis) == 2  # the loss itself is additive


def test_batchnorm_and_mean_loss_are_both_named() -> None:
    report = verify(_mlp(bn=True), _classification(), _mean_loss, micro_batch_size=4)
    assert report.diagnosis[1].startswith("train-mode BatchNorm")
    assert report.diagnosis[2].startswith("mean-reduced loss")


def test_eval_mode_batchnorm_passes() -> None:
    model = _mlp(bn=True)
    model[1].eval()
    assert verify(model, _classification(), _sum_loss, micro_batch_size=4).passed


def _state(model: nn.Module) -> dict:
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "grads": {n: p.grad for n, p in model.named_parameters()},
        "grad_values": {
            n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()
        },
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "training": {n: m.training for n, m in model.named_modules()},
    }


def _assert_same_state(model: nn.Module, before: dict) -> None:
    after = _state(model)
    for key in ("params", "buffers", "grad_values"):
        for name, value in before[key].items():
            other = after[key][name]
            assert (value is None) == (other is None), (key, name)
            if value is not None:
                assert torch.equal(value, other), (key, name)
    assert all(after["grads"][n] is g for n, g in before["grads"].items())  # same objects
    assert after["requires_grad"] == before["requires_grad"]
    assert after["training"] == before["training"]


@pytest.mark.parametrize("loss_fn", [_sum_loss, _mean_loss])
def test_model_and_rng_are_left_unchanged(loss_fn) -> None:
    model = _mlp(bn=True, dropout=0.3)
    model[0].weight.grad = torch.full_like(model[0].weight, 0.5)  # a user's pending gradient
    model[0].bias.requires_grad_(False)
    model[2].eval()  # mixed training flags
    before = _state(model)
    rng = torch.get_rng_state()
    verify(model, _classification(), loss_fn, micro_batch_size=3)
    _assert_same_state(model, before)
    assert torch.equal(torch.get_rng_state(), rng)
    assert model[1].num_batches_tracked.item() == 0  # BN statistics untouched


def test_state_is_restored_when_loss_fn_raises() -> None:
    model = _mlp(bn=True)
    before, rng = _state(model), torch.get_rng_state()
    calls = []

    def failing(model, micro):
        calls.append(1)
        if len(calls) == 3:
            raise KeyError("boom")
        return _sum_loss(model, micro)

    with pytest.raises(KeyError, match="boom"):
        verify(model, _classification(), failing, micro_batch_size=4)
    _assert_same_state(model, before)
    assert torch.equal(torch.get_rng_state(), rng)


def test_dropout_is_disabled_and_reported() -> None:
    model = _mlp(dropout=0.5)
    report = verify(model, _classification(), _sum_loss, micro_batch_size=3)
    assert report.passed, report
    note = "dropout module 2 (Dropout, p=0.5): p set to 0 and put in eval mode"
    assert any(note in n for n in report.notes)
    assert model[2].p == 0.5
    assert model[2].training


def test_functional_attention_dropout_is_disabled_and_restored() -> None:
    model = _tiny_llama(attention_dropout=0.5)
    report = verify(model, _padded_tokens(), _lm_loss, micro_batch_size=2)
    assert report.passed, report
    assert any("self_attn.attention_dropout = 0.5 set to 0.0" in n for n in report.notes)
    assert model.model.layers[0].self_attn.attention_dropout == 0.5


def test_randomness_that_cannot_be_disabled_is_reported() -> None:
    class HardDropout(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(5, 4).double()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.dropout(self.linear(x), 0.3, training=True)

    report = verify(HardDropout(), _classification(), _sum_loss, micro_batch_size=3)
    assert not report.passed
    assert any(d.startswith("randomness left") for d in report.diagnosis)
    assert not any(d.startswith("coupled") for d in report.diagnosis)  # not a false cause
    assert report.nondeterminism > 1e-3


def test_low_precision_is_compared_on_a_float32_copy() -> None:
    model = _mlp(torch.bfloat16)
    report = verify(model, _classification(dtype=torch.bfloat16), _sum_loss, micro_batch_size=3)
    assert report.passed, report
    assert report.dtype == "float32" and report.tolerance == 1e-5
    assert "compared on a float32 copy of the bfloat16 model" in report.notes
    assert model[0].weight.dtype == torch.bfloat16


def test_dtype_argument_compares_on_a_float64_copy() -> None:
    report = verify(
        _mlp(torch.float32),
        _classification(dtype=torch.float32),
        _sum_loss,
        micro_batch_size=3,
        dtype=torch.float64,
    )
    assert report.passed and report.tolerance == 1e-10 and report.dtype == "float64"


@pytest.mark.parametrize("size", [8, 9])
def test_single_micro_batch_is_refused_as_trivial(size: int) -> None:
    with pytest.raises(
        ValueError,
        match=rf"micro_batch_size {size} >= the batch's 8 rows: .*"
        r"proves nothing; pass micro_batch_size=4 or smaller",
    ):
        verify(_mlp(), _classification(), _sum_loss, micro_batch_size=size)
    with pytest.raises(ValueError, match="the batch has 1 row: verify needs at least 2 rows"):
        one_row = {"x": torch.randn(1, 5, dtype=torch.float64), "y": torch.tensor([2])}
        verify(_mlp(), one_row, _sum_loss, micro_batch_size=1)


def test_assert_equivalent() -> None:
    report = assert_equivalent(_mlp(), _classification(), _sum_loss, micro_batch_size=3)
    assert report.passed
    with pytest.raises(AssertionError, match=r"(?s)FAILED.*mean-reduced loss"):
        assert_equivalent(_mlp(), _classification(), _mean_loss, micro_batch_size=3)


def test_bad_arguments_name_the_value_and_fix() -> None:
    with pytest.raises(ValueError, match="micro_batch_size must be a positive int, got 0"):
        verify(_mlp(), _classification(), _sum_loss, micro_batch_size=0)
    with pytest.raises(TypeError, match=r"expected \(loss_sum, count\)"):
        verify(_mlp(), _classification(), lambda m, b: m(b["x"]).sum(), micro_batch_size=2)
    batch = _classification()
    batch["y"][:] = -100
    with pytest.raises(ValueError, match="counts 0 items"):
        verify(_mlp(), batch, _sum_loss, micro_batch_size=2)
    with pytest.raises(ValueError, match=r"batch\['w'\] has shape \(3,\)"):
        verify(_mlp(), {**_classification(), "w": torch.ones(3)}, _sum_loss, micro_batch_size=2)


def test_compare_is_per_tensor_and_global() -> None:
    big = torch.zeros(10_000)
    big[0] = 100.0  # the whole gradient's RMS entry is 1.0: the floor of the per-tensor measure
    ref = {"big": big, "small": torch.tensor([1.0]), "none": None}
    got = {"big": big, "small": torch.tensor([1.1]), "none": None}
    worst, name, global_error = compare(ref, got)
    assert name == "small" and worst == pytest.approx(0.1)
    assert global_error == pytest.approx(0.1 / 100.005, rel=1e-4)  # hidden by "big"


@settings(max_examples=20, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 4), min_size=2, max_size=9),
    micro_batch_size=st.integers(1, 4),
)
def test_any_split_of_any_ragged_batch_passes(lengths: list[int], micro_batch_size: int) -> None:
    micro_batch_size = min(micro_batch_size, len(lengths) - 1)  # 2 micro-batches at least
    # rows with 1..4 labelled positions each (the rest -100): counts vary per micro-batch
    model = nn.Linear(5, 4).double()
    gen = torch.Generator().manual_seed(len(lengths))
    x = torch.randn(len(lengths), 4, 5, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 4, (len(lengths), 4), generator=gen)
    for row, length in enumerate(lengths):
        y[row, length:] = -100
    report = verify(
        model,
        {"x": x, "y": y},
        lambda m, b: fb.cross_entropy_sum(m(b["x"]), b["y"]),
        micro_batch_size=micro_batch_size,
    )
    assert report.passed, report


def test_public_names() -> None:
    assert fb.verify is verify
    assert fb.testing.assert_equivalent is assert_equivalent
    assert isinstance(
        fb.verify(_mlp(), _classification(), _sum_loss, micro_batch_size=3), fb.VerifyReport
    )


def test_a_wrong_fullbatch_gradient_is_called_a_bug(monkeypatch: pytest.MonkeyPatch) -> None:
    from fullbatch._verify import _arms as _verify_arms

    record = _verify_arms.GradientRecorder.step

    def off_by_a_little(self, closure=None):
        record(self)
        self.recorded = [None if g is None else g * 1.001 for g in self.recorded]

    monkeypatch.setattr(_verify_arms.GradientRecorder, "step", off_by_a_little)
    report = verify(_mlp(), _classification(), _sum_loss, micro_batch_size=3)
    assert not report.passed
    assert len(report.diagnosis) == 1
    assert "this is a fullbatch bug" in report.diagnosis[0]


def test_float64_model_with_float32_internals_gets_float32_tolerance() -> None:
    # Llama's RMSNorm upcasts to float32 even in a float64 model: 1e-10 is out of reach, and
    # the rounding band (normalizing after backward instead of before) shows it.
    model = _tiny_llama().double()
    report = verify(model, _padded_tokens(), _lm_loss, micro_batch_size=2)
    assert report.passed, report
    assert report.dtype == "float64" and report.tolerance == 1e-5
    assert report.rounding_band > 1e-10
    assert any("computes partly in float32" in n for n in report.notes)


def test_float64_mlp_has_a_float64_rounding_band() -> None:
    report = verify(_mlp(), _classification(), _sum_loss, micro_batch_size=3)
    assert report.rounding_band < 1e-14 and report.tolerance == 1e-10

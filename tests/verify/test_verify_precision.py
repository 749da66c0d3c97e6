"""``verify`` in bfloat16 / float16: pass inside the model's own rounding band, fail beyond it.

Under bf16 autocast fullbatch is exact up to bf16 rounding, and so is the full batch itself:
its gradient moves by about as much when its loss is normalized after backward, or its rows
are permuted (issue 8, item 7). Numbers are checked against plain full-batch PyTorch.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fullbatch as fb

transformers = pytest.importorskip("transformers")


def _tiny_llama(dtype: torch.dtype = torch.float32) -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(dtype).train()


def _tiny_gpt2(dtype: torch.dtype = torch.float32) -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=64,
        n_positions=32,
        n_embd=64,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).to(dtype).train()


def _padded(rows: int = 8, width: int = 12) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 64, (rows, width), generator=gen)
    labels, mask = ids.clone(), torch.ones_like(ids)
    for row in range(rows):
        length = int(torch.randint(2, width + 1, (1,), generator=gen))
        labels[row, length:] = -100
        mask[row, length:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _loss(model: nn.Module, micro: dict) -> tuple[torch.Tensor, torch.Tensor]:
    out = model(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"])
    return fb.causal_lm_loss(out.logits, micro["labels"])


def _bf16_loss(model: nn.Module, micro: dict) -> tuple[torch.Tensor, torch.Tensor]:
    # the user's own autocast inside loss_fn (as in many training loops)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return _loss(model, micro)


def _mean_bf16_loss(model: nn.Module, micro: dict) -> tuple[torch.Tensor, torch.Tensor]:
    loss_sum, count = _bf16_loss(model, micro)
    return loss_sum / count, count  # a mean: a genuinely wrong recipe


def _plain_grad_norm(model: nn.Module, batch: dict, *, autocast: bool) -> float:
    """Plain full-batch PyTorch: mean loss over the batch, one backward (dropout off)."""
    model.eval()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss_sum, count = _loss(model, batch)
    (loss_sum / count).backward()
    norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters()))
    model.zero_grad(set_to_none=True)
    model.train()
    return float(norm)


def test_loss_fn_under_bf16_autocast_passes_within_the_band() -> None:
    model = _tiny_llama()
    report = fb.verify(model, _padded(), _bf16_loss, micro_batch_size=3)
    assert report.passed, report
    # really bf16 rounding: far above float32's 1e-5, inside the measured band
    assert 1e-4 < report.fullbatch.worst_error <= report.tolerance
    assert report.tolerance == pytest.approx(4 * report.rounding_band)
    assert any("rounding band" in note for note in report.notes), report
    assert report.naive.worst_error > 10 * report.tolerance  # a wrong recipe stays far outside
    assert report.grad_norm == pytest.approx(_plain_grad_norm(model, _padded(), autocast=True))


def test_autocast_option_runs_forward_and_loss_under_autocast() -> None:
    model = _tiny_gpt2()
    report = fb.verify(model, _padded(), _loss, micro_batch_size=3, autocast=torch.bfloat16)
    assert report.passed, report
    assert report.dtype == "float32 + bfloat16 autocast"
    assert report.fullbatch.worst_error > 1e-4  # bf16 rounding happened, so autocast was on
    assert report.grad_norm == pytest.approx(_plain_grad_norm(model, _padded(), autocast=True))
    assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("make", [_tiny_llama, _tiny_gpt2])
def test_bf16_model_compared_in_its_own_dtype_passes(make) -> None:
    model = make(torch.bfloat16)
    report = fb.verify(model, _padded(), _loss, micro_batch_size=3, dtype=torch.bfloat16)
    assert report.passed, report
    assert report.dtype == "bfloat16"
    assert report.fullbatch.worst_error <= report.tolerance
    assert report.naive.worst_error > report.tolerance


def test_float16_autocast_passes() -> None:
    report = fb.verify(_tiny_llama(), _padded(), _loss, micro_batch_size=3, autocast=torch.float16)
    assert report.passed, report
    assert report.dtype == "float32 + float16 autocast"


def test_mean_reduced_loss_still_fails_under_bf16() -> None:
    report = fb.verify(_tiny_llama(), _padded(), _mean_bf16_loss, micro_batch_size=3)
    assert not report.passed
    assert any("mean-reduced loss" in d for d in report.diagnosis), report
    assert str(report).startswith("fullbatch verify: FAILED")


def test_an_explicit_rtol_is_kept() -> None:
    report = fb.verify(_tiny_llama(), _padded(), _bf16_loss, micro_batch_size=3, rtol=1e-6)
    assert not report.passed and report.tolerance == 1e-6


@pytest.mark.parametrize("bad", [torch.float32, "bf16", torch.int8])
def test_bad_autocast_names_the_value_and_fix(bad) -> None:
    with pytest.raises(ValueError, match=r"autocast must be torch.bfloat16 or torch.float16"):
        fb.verify(_tiny_llama(), _padded(), _loss, micro_batch_size=3, autocast=bad)


def test_a_wrong_fullbatch_gradient_still_fails_under_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    from fullbatch._verify import _arms

    record = _arms.GradientRecorder.step

    def off_by_a_fifth(self, closure=None):
        record(self)
        self.recorded = [None if g is None else g * 1.2 for g in self.recorded]

    monkeypatch.setattr(_arms.GradientRecorder, "step", off_by_a_fifth)
    report = fb.verify(_tiny_llama(), _padded(), _bf16_loss, micro_batch_size=3)
    assert not report.passed
    assert "this is a fullbatch bug" in report.diagnosis[0], report


def test_assert_equivalent_takes_autocast() -> None:
    report = fb.testing.assert_equivalent(
        _tiny_gpt2(), _padded(), _loss, micro_batch_size=3, autocast=torch.bfloat16
    )
    assert report.dtype == "float32 + bfloat16 autocast"


def test_cli_autocast(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    import json

    from fullbatch.cli import main

    model_file = tmp_path / "bf16_model.py"
    model_file.write_text(
        "import transformers, torch\n\n"
        "def make():\n"
        "    torch.manual_seed(0)\n"
        "    return transformers.GPT2LMHeadModel(transformers.GPT2Config(\n"
        "        vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=2,\n"
        "        bos_token_id=0, eos_token_id=0))\n"
    )
    data = tmp_path / "rows.jsonl"
    rows = [[1, 2, 3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13], [14, 15, 16, 17, 18, 19]]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    argv = ["verify", "--model", f"{model_file}:make", "--data", str(data)]
    code = main([*argv, "--micro-batch-size", "2", "--autocast", "bfloat16"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert out.startswith("fullbatch verify: PASSED (float32 + bfloat16 autocast")


def test_naive_within_a_wide_band_is_said_to_be_unresolved() -> None:
    # micro-batches counting 24 and 25 items: the naive recipe is off by a few percent only,
    # inside bf16's band; the report must not claim the counts are equal
    batch = _padded(width=10)
    for row, length in enumerate([7, 7, 7, 7, 10, 10, 4, 5]):
        batch["labels"][row, :length] = batch["input_ids"][row, :length]
        batch["labels"][row, length:] = -100
        batch["attention_mask"][row, :length] = 1  # labels count only real tokens
        batch["attention_mask"][row, length:] = 0
    report = fb.verify(_tiny_llama(), batch, _loss, micro_batch_size=4, autocast=torch.bfloat16)
    assert report.passed, report
    assert report.naive.worst_error <= report.tolerance  # what this test is about
    assert any("cannot tell it from the full batch" in n for n in report.notes), report
    assert not any("naive recipe is exact here too" in n for n in report.notes)

"""Flattening rows into one sequence (padding-free packing with restarted ``position_ids``) on
a transformers Llama with its default attention: the gradient is not the padded run's, and
``fb.verify`` says so (it must never PASS such a loss_fn)."""

from __future__ import annotations

import pytest
import torch

import fullbatch as fb
from conftest import IGNORE

transformers = pytest.importorskip("transformers")

from test_hf_models import padded_rows, tiny_llama  # noqa: E402  (after the importorskip)

LENGTHS = [12, 5, 20, 3, 17, 9, 24, 7]


def batch() -> dict[str, torch.Tensor]:
    out = padded_rows(LENGTHS, 96, 24, seed=1)
    out["labels"] = out["input_ids"].masked_fill(out["attention_mask"] == 0, IGNORE)
    return out


def padded(model, micro):
    logits = model(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"]).logits
    return fb.causal_lm_loss(logits, micro["labels"])


def flattened(model, micro):
    """The micro-batch's real tokens as one row, positions restarting at every row, and no
    prediction across a row boundary: what padding-free packing does."""
    mask = micro["attention_mask"].bool()
    n = mask.sum(1)
    ids = micro["input_ids"][mask][None]
    positions = torch.cat([torch.arange(int(k)) for k in n])[None]
    labels = micro["labels"][mask].clone()
    labels[torch.cumsum(n, 0) - n] = IGNORE  # a row's first token is not predicted
    logits = model(input_ids=ids, position_ids=positions).logits
    return fb.causal_lm_loss(logits, labels[None])


def gradient(model, loss_fn, data) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss_sum, n = loss_fn(model, data)
    (loss_sum / n).backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def test_flattening_changes_the_gradient_on_default_attention() -> None:
    model = tiny_llama().double()
    data = batch()
    want = gradient(model, padded, data)
    got = gradient(model, flattened, data)
    diff = sum(float((g - w).square().sum()) for g, w in zip(got, want, strict=True)) ** 0.5
    norm = sum(float(w.square().sum()) for w in want) ** 0.5
    print(f"\nflattened vs padded ({model.config._attn_implementation}): {diff / norm:.1%}")
    # same tokens, same labels, same count: only the attention across rows differs
    assert padded(model, data)[1] == flattened(model, data)[1]
    assert diff / norm > 0.1


def test_verify_fails_a_flattening_loss_and_passes_the_padded_one() -> None:
    model = tiny_llama()
    data = batch()
    report = fb.verify(model, data, flattened, micro_batch_size=3, dtype=torch.float64)
    assert not report.passed
    assert report.fullbatch.max_rel_error > 0.1
    assert report.additivity is not None and not report.additivity.holds
    assert any("not the sum of its halves" in line for line in report.diagnosis)
    ok = fb.verify(model, data, padded, micro_batch_size=3, dtype=torch.float64)
    assert ok.passed, str(ok)

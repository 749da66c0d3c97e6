"""Hugging Face models built from a config (random init, no download): a masked-LM encoder
(BERT, attention-mask padding, 15% masks) and a causal LM (Llama, right-padded rows)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import fullbatch as fb
from conftest import IGNORE, params, rel_err, rel_err_per_tensor

transformers = pytest.importorskip("transformers")

MASK_ID = 3


def hf_logits(model, micro) -> torch.Tensor:
    return model(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"]).logits


def padded_rows(lengths, vocab: int, width: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rows = len(lengths)
    ids = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros(rows, width, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(5, vocab, (n,), generator=g)
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask}


def grads_given_to_optimizer(model, opt) -> list[list[torch.Tensor]]:
    """Record, at every optimizer step, the gradients fullbatch hands to the optimizer."""
    seen: list[list[torch.Tensor]] = []

    def hook(optimizer, args, kwargs):
        seen.append(
            [
                p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                for p in model.parameters()
            ]
        )

    opt.register_step_pre_hook(hook)
    return seen


# -- BERT: masked LM -------------------------------------------------------------------------


def tiny_bert():
    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(config)
    model.train()
    return model


def mlm_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    lengths = [16, 5, 11, 3, 14, 8, 2]
    batch = padded_rows(lengths, 64, 16, seed)
    g = torch.Generator().manual_seed(seed + 1)
    chosen = (torch.rand(batch["input_ids"].shape, generator=g) < 0.15) & (
        batch["attention_mask"] == 1
    )
    chosen[0, 1] = True  # at least one masked token
    batch["labels"] = batch["input_ids"].masked_fill(~chosen, IGNORE)
    batch["input_ids"] = batch["input_ids"].masked_fill(chosen, MASK_ID)
    return batch


@pytest.mark.parametrize("size", [1, 2, 3, 7])
def test_bert_masked_lm_one_step_equals_full_batch(size: int) -> None:
    model = tiny_bert()
    batch = mlm_batch()
    ref_model = copy.deepcopy(model)
    logits = hf_logits(ref_model, batch)
    ref_loss = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1), ignore_index=IGNORE
    )
    ref_loss.backward()
    ref_grads = [
        p.grad if p.grad is not None else torch.zeros_like(p) for p in ref_model.parameters()
    ]
    ref_norm = math.sqrt(sum(float(g.double().square().sum()) for g in ref_grads))

    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    seen = grads_given_to_optimizer(model, opt)
    with fb.Accumulator(model, opt, micro_batch_size=size) as acc:
        for window in acc.windows([batch]):
            for micro in window:
                loss_sum, n = fb.cross_entropy_sum(hf_logits(model, micro), micro["labels"])
                window.backward(loss_sum, n)
            stats = window.step()
    assert len(seen) == 1 and not stats.skipped
    assert stats.count == int((batch["labels"] != IGNORE).sum())
    # over all tensors together: some gradients are mathematically zero (the attention key
    # bias: softmax is shift-invariant) and hold only rounding noise on both sides
    assert rel_err(seen[0], ref_grads) < 1e-5
    assert stats.loss == pytest.approx(float(ref_loss.detach()), rel=1e-5)
    assert stats.grad_norm == pytest.approx(ref_norm, rel=1e-5)


# -- Llama: causal LM, several momentum-SGD steps ---------------------------------------------


def tiny_llama():
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.train()
    return model


def lm_windows(steps: int = 4) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for s in range(steps):
        lengths = torch.randint(2, 25, (10,), generator=g).tolist()
        lengths[s % 10] = 24
        batch = padded_rows(lengths, 96, 24, seed=100 + s)
        batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, IGNORE)
        out.append(batch)
    return out


def make_sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def shifted_ce(logits, labels, reduction="mean"):
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]),
        labels[:, 1:].reshape(-1),
        ignore_index=IGNORE,
        reduction=reduction,
    )


def full_batch_run(model, windows):
    opt = make_sgd(model)
    for batch in windows:
        opt.zero_grad(set_to_none=True)
        shifted_ce(hf_logits(model, batch), batch["labels"]).backward()
        opt.step()
    return params(model)


def naive_run(model, windows, size: int):
    """The mean-of-means recipe: each micro-batch's mean loss divided by their number."""
    opt = make_sgd(model)
    for batch in windows:
        opt.zero_grad(set_to_none=True)
        rows = batch["input_ids"].shape[0]
        starts = range(0, rows, size)
        for i in starts:
            micro = {k: v[i : i + size] for k, v in batch.items()}
            if (micro["labels"][:, 1:] != IGNORE).sum() == 0:
                continue  # a mean over no tokens is NaN: naive loops skip it
            loss = shifted_ce(hf_logits(model, micro), micro["labels"]) / len(starts)
            loss.backward()
        opt.step()
    return params(model)


def fullbatch_run(model, windows, size: int):
    opt = make_sgd(model)
    with fb.Accumulator(model, opt, micro_batch_size=size) as acc:
        for window in acc.windows(windows):
            for micro in window:
                loss_sum, n = fb.causal_lm_loss(hf_logits(model, micro), micro["labels"])
                window.backward(loss_sum, n)
            assert not window.step().skipped
    return params(model)


def trajectory_error(got, ref, start) -> float:
    """max over tensors of max|got - ref| / max|ref - start| (relative to the distance moved)."""
    return rel_err_per_tensor(
        [g - s for g, s in zip(got, start, strict=True)],
        [r - s for r, s in zip(ref, start, strict=True)],
    )


def test_llama_causal_lm_steps_equal_full_batch_and_naive_does_not() -> None:
    windows = lm_windows(4)
    model = tiny_llama()
    start = params(model)
    ref = full_batch_run(copy.deepcopy(model), windows)
    # float32 rounding band: the same full batch with its rows in reverse order
    flipped = [{k: v.flip(0) for k, v in w.items()} for w in windows]
    drift = trajectory_error(full_batch_run(copy.deepcopy(model), flipped), ref, start)
    errors, naive_errors, moved = {}, {}, {}
    for size in (1, 3, 8):
        got = fullbatch_run(copy.deepcopy(model), windows, size)
        naive = naive_run(copy.deepcopy(model), windows, size)
        errors[size] = rel_err_per_tensor(got, ref)  # max over tensors of max|Δ| / max|ref|
        naive_errors[size] = rel_err_per_tensor(naive, ref)
        moved[size] = trajectory_error(got, ref, start)
    print(f"\nllama: fullbatch {errors}, naive {naive_errors}")
    print(f"relative to the distance moved: fullbatch {moved}, row-order drift {drift:.2e}")
    assert all(e < 1e-5 for e in errors.values()), errors
    assert all(e > 1e-3 for e in naive_errors.values()), naive_errors
    assert all(m <= 10 * max(drift, 1e-6) for m in moved.values()), (moved, drift)

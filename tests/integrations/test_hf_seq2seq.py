"""ExactTrainer(loss="seq2seq") on encoder-decoders (tiny float64 T5 and BART) against a plain
full batch: each window's rows as one batch through the model's own loss (``labels=`` given, so
the model builds ``decoder_input_ids`` itself), one SGD step. ``causal_lm`` on them is refused."""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import fullbatch.hf as fbhf
from _hf_cases import in_order, training_args
from fullbatch._demo._trl_tiny import tiny_causal_lm, tiny_seq2seq

# float64 models; T5's layer norm computes its variance in float32 (its band: 3e-8 measured over
# three steps), BART is float64 end to end.
TOL = {"t5": 2e-7, "bart": 1e-10}


def _rows(n: int) -> list[dict[str, Any]]:
    return [
        {"input_ids": [5 + (i * 7 + j) % 90 for j in range(3 + i % 5)] + [1],
         "labels": [5 + (i * 3 + j) % 90 for j in range(2 + (i * 2) % 7)] + [1]}
        for i in range(n)
    ]  # fmt: skip


def _collate(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    def pad(seqs: list[list[int]], fill: int) -> torch.Tensor:
        width = max(len(s) for s in seqs)
        return torch.tensor([s + [fill] * (width - len(s)) for s in seqs])

    ids = [r["input_ids"] for r in rows]
    return {
        "input_ids": pad(ids, 0),
        "attention_mask": pad([[1] * len(s) for s in ids], 0),
        "labels": pad([r["labels"] for r in rows], -100),
    }


@pytest.mark.parametrize("kind", ["t5", "bart"])
def test_seq2seq_every_step_equals_full_batch(kind: str) -> None:
    rows = _rows(10)  # 2 rows per micro-batch, K=2: windows of 4, 4, 2 rows
    model = tiny_seq2seq(kind)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = fbhf.ExactTrainer(
            model=model,
            args=training_args(tmp, k=2, batch=2),
            train_dataset=rows,
            data_collator=_collate,
            loss="seq2seq",
        )
        in_order(trainer).train()  # older Trainers (4.53) always shuffle: see in_order
    ref = tiny_seq2seq(kind)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for w in range(0, len(rows), 4):
        ref(**_collate(rows[w : w + 4])).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    init = dict(tiny_seq2seq(kind).named_parameters())
    got, want = dict(model.named_parameters()), dict(ref.named_parameters())
    diff = sum(float((got[n] - want[n]).pow(2).sum()) for n in want) ** 0.5
    moved = sum(float((want[n] - init[n]).pow(2).sum()) for n in want) ** 0.5
    assert diff / moved < TOL[kind]


def test_token_kinds_refused_on_encoder_decoders_and_seq2seq_on_decoders() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        args = training_args(tmp, k=2, batch=2)
        with pytest.raises(ValueError, match=r"encoder-decoder.*pass loss='seq2seq'"):
            fbhf.ExactTrainer(model=tiny_seq2seq("t5"), args=args, loss="causal_lm")
        with pytest.raises(ValueError, match="pass loss='causal_lm'"):
            fbhf.ExactTrainer(model=tiny_causal_lm("llama"), args=args, loss="seq2seq")


def test_check_trainer_on_t5() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        trainer = fbhf.ExactTrainer(
            model=tiny_seq2seq("t5"),
            args=training_args(tmp, k=4, batch=2),
            data_collator=_collate,
            loss="seq2seq",
        )
        check = fbhf.check_trainer(trainer, _rows(8))
    assert check.passed and check.accumulated.grad_norm > 0, str(check)

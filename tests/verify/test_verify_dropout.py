"""``verify`` switches dropout off completely, even where a module reads ``dropout.p`` itself.

GPT-2's attention calls ``F.dropout(p=self.attn_dropout.p, training=self.training)``: putting
the ``nn.Dropout`` in eval mode does not reach it, so verify also sets ``p = 0`` (issue 8,
item 6). Stock configs only, built offline.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

import fullbatch as fb
from fullbatch.cli import main

transformers = pytest.importorskip("transformers")


def _tiny_gpt2() -> torch.nn.Module:
    # default dropouts: resid_pdrop = embd_pdrop = attn_pdrop = 0.1
    config = transformers.GPT2Config(
        vocab_size=64,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).train()


def _batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (6, 10), generator=gen)
    labels = ids.clone()
    labels[0, 5:] = -100
    labels[3, 2:] = -100
    return {"input_ids": ids, "labels": labels}


def _loss(model: torch.nn.Module, micro: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return fb.causal_lm_loss(model(input_ids=micro["input_ids"]).logits, micro["labels"])


def _full_batch_grads(model: torch.nn.Module, batch: dict) -> dict[str, torch.Tensor]:
    # plain PyTorch, no dropout at all: the reference verify must agree with
    model.eval()
    loss_sum, n = _loss(model, batch)
    (loss_sum / n).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    model.train()
    return grads


def test_stock_gpt2_passes_with_dropout_fully_off() -> None:
    model = _tiny_gpt2()
    attn = model.transformer.h[0].attn
    assert attn.attn_dropout.p == 0.1  # the stock default, read by attention itself
    report = fb.verify(model, _batch(), _loss, micro_batch_size=2)
    assert report.passed, report
    assert report.nondeterminism == 0, report
    assert any(
        "transformer.h.0.attn.attn_dropout (Dropout, p=0.1): p set to 0" in note
        for note in report.notes
    ), report.notes
    # restored: same p, same training flags
    assert attn.attn_dropout.p == 0.1 and attn.attn_dropout.training and model.training
    # and the reference verify used is plain full-batch PyTorch without dropout
    expected = _full_batch_grads(model, _batch())
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in expected.values()))
    assert abs(report.grad_norm - float(norm)) <= 1e-5 * float(norm)


_GPT2_FILE = textwrap.dedent(
    """
    import torch
    import transformers


    def make():
        config = transformers.GPT2Config(
            vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
            eos_token_id=0,
        )
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(config)
    """
)


def test_cli_passes_on_stock_gpt2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    model_file = tmp_path / "gpt2_model.py"
    model_file.write_text(_GPT2_FILE)
    data = tmp_path / "rows.jsonl"
    rows = [[1, 2, 3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13], [14, 15, 16, 17, 18, 19]]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    code = main(
        ["verify", "--model", f"{model_file}:make", "--data", str(data), "--micro-batch-size", "2"]
    )
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert out.startswith("fullbatch verify: PASSED"), out
    assert "p set to 0" in out

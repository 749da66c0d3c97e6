"""``fullbatch.hf.ExactTrainer`` on a transformers MoE model: the load-balancing loss is the
window's (a no-grad pre-pass of routing counts), so one accumulated step equals one forward of
the whole window (token-mean cross-entropy + coef · transformers' pooled load-balancing loss);
the stock Trainer, which adds each micro-batch's own aux term, is measurably off."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
import torch.nn.functional as F
import transformers

import fullbatch.hf as fbhf
from _moe_cases import COEF, VOCAB, aux64, forward, make_moe, moe_rows, reference, rel_err, update

LENGTHS = (7, 3, 5, 7, 2, 6)  # real tokens per row: uneven micro-batches of 2 rows


def _collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def _step(model: Any, trainer_cls: Any, tmp_path: Any, **kw: Any) -> list[torch.Tensor]:
    window = moe_rows(LENGTHS, seed=1)
    data = [{k: v[i] for k, v in window.items()} for i in range(len(LENGTHS))]
    args = transformers.TrainingArguments(
        str(tmp_path),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=3,
        max_steps=1,
        learning_rate=1.0,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
    )
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    trainer = trainer_cls(
        model=model,
        args=args,
        train_dataset=data,
        data_collator=_collate,
        optimizers=(opt, None),
        **kw,
    )
    trainer.train()
    return update(before, model)


def _summed_reference(model: Any, rows: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The same full batch, its loss *summed* over the tokens, backpropagated and divided by
    the count afterwards (plain PyTorch): Mixtral's RMSNorm computes in float32 inside, so
    this rounds differently from the mean's backward (4e-8 here), as ExactTrainer does."""
    out = forward(model, rows)
    labels = rows["labels"][:, 1:]
    n = int((labels != -100).sum())
    logits = out.logits[:, :-1].reshape(-1, VOCAB)
    ce = F.cross_entropy(logits, labels.reshape(-1), ignore_index=-100, reduction="sum")
    (ce + n * COEF * aux64(out.router_logits, rows["attention_mask"])).backward()
    return [torch.zeros_like(p) if p.grad is None else p.grad / n for p in model.parameters()]


def test_exact_trainer_moe_step_equals_full_batch(tmp_path: Any) -> None:
    model = make_moe("mixtral")
    model.config.output_router_logits = True  # the stock loss then adds coef · aux
    rows = moe_rows(LENGTHS, seed=1)
    want, _ = reference(copy.deepcopy(model), rows)  # checks transformers' own loss agrees
    summed = _summed_reference(copy.deepcopy(model), rows)
    stock = _step(copy.deepcopy(model), transformers.Trainer, tmp_path / "stock")
    got = _step(model, fbhf.ExactTrainer, tmp_path / "exact", loss="causal_lm")
    assert rel_err(got, summed) < 1e-10, rel_err(got, summed)  # rounding only
    assert rel_err(got, want) < 1e-7, rel_err(got, want)  # the float32 RMSNorm inside
    assert rel_err(stock, want) > 1e-3, rel_err(stock, want)  # the control: per micro-batch


def test_exact_trainer_without_router_logits_adds_no_aux(tmp_path: Any) -> None:
    """``output_router_logits=False``: transformers adds no aux term, nor does ExactTrainer."""
    model = make_moe("mixtral")
    assert fbhf.ExactTrainer.__module__ == "fullbatch.hf"
    from fullbatch.hf._moe import moe_aux_of

    assert moe_aux_of(model) is None
    model.config.output_router_logits = True
    aux = moe_aux_of(model)
    assert aux is not None and (aux.coef, aux.top_k) == (0.25, 2)

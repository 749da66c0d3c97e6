"""Tiny transformers MoE models (Mixtral, Qwen3-MoE, OLMoE), windows with padding, and the
plain full-batch reference the window-statistics tests compare fullbatch against.

The reference never calls fullbatch: one forward of the whole window, the token-mean
cross-entropy and the pooled load-balancing loss written out here in float64 (transformers'
own ``load_balancing_loss_func`` sums probabilities in float32; :func:`reference` checks
that it agrees with this one to that precision, so the objective is the stock one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import fullbatch as fb

FAMILIES = ("mixtral", "qwen3_moe", "olmoe")
VOCAB, SEQ, EXPERTS, TOP_K, COEF = 48, 7, 4, 2, 0.25


def make_moe(family: str, seed: int = 0, layers: int = 2) -> nn.Module:
    """A tiny float64 transformers MoE causal LM with random weights (eager experts)."""
    import transformers

    torch.manual_seed(seed)
    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        num_experts_per_tok=TOP_K,
        router_aux_loss_coef=COEF,
        experts_implementation="eager",
        attn_implementation="eager",
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    if family == "mixtral":
        config = transformers.MixtralConfig(num_local_experts=EXPERTS, **common)
        cls: Any = transformers.MixtralForCausalLM
    elif family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            num_experts=EXPERTS, moe_intermediate_size=12, norm_topk_prob=True, **common
        )
        cls = transformers.Qwen3MoeForCausalLM
    else:
        config = transformers.OlmoeConfig(num_experts=EXPERTS, **common)
        cls = transformers.OlmoeForCausalLM
    return cls(config).double()


def moe_rows(lengths: Sequence[int], seed: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded rows of ``lengths`` real tokens: input_ids, attention_mask, labels."""
    g = torch.Generator().manual_seed(seed)
    n = len(lengths)
    ids = torch.randint(3, VOCAB, (n, SEQ), generator=g)
    mask = torch.zeros(n, SEQ, dtype=torch.long)
    for i, length in enumerate(lengths):
        mask[i, :length] = 1
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :2] = -100  # a prompt
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def split(rows: dict[str, torch.Tensor], sizes: Sequence[int]) -> list[dict[str, torch.Tensor]]:
    out, start = [], 0
    for size in sizes:
        out.append({k: v[start : start + size] for k, v in rows.items()})
        start += size
    return out


def forward(model: nn.Module, micro: dict[str, torch.Tensor]) -> Any:
    return model(
        input_ids=micro["input_ids"],
        attention_mask=micro["attention_mask"],
        output_router_logits=True,
    )


def aux64(router_logits: Sequence[torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """The pooled load-balancing loss of one batch, written out in float64."""
    flat = mask.reshape(-1).double()
    counts = torch.zeros(EXPERTS, dtype=torch.float64)
    probs = torch.zeros(EXPERTS, dtype=torch.float64)
    rows = torch.zeros((), dtype=torch.float64)
    for layer in router_logits:
        p = torch.softmax(layer.double(), dim=-1)
        top = torch.topk(p, TOP_K, dim=-1).indices
        hits = F.one_hot(top, EXPERTS).sum(1).double()
        counts = counts + (hits * flat[:, None]).sum(0)
        probs = probs + (p * flat[:, None]).sum(0)
        rows = rows + flat.sum()
    return EXPERTS * ((counts / rows) * (probs / rows)).sum()


def reference(model: nn.Module, rows: dict[str, torch.Tensor]) -> tuple[list[torch.Tensor], float]:
    """Gradient and loss of CE token mean + coef · load balancing over the whole window."""
    model.zero_grad(set_to_none=True)
    out = forward(model, rows)
    logits = out.logits[:, :-1]
    labels = rows["labels"][:, 1:]
    ce = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
    aux = aux64(out.router_logits, rows["attention_mask"])
    loss = ce + COEF * aux
    # The objective is transformers' own: its forward with labels gives the same loss.
    stock = model(**rows, output_router_logits=True).loss
    assert abs(stock.item() - loss.item()) < 1e-6 * abs(loss.item())
    loss.backward()
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads, loss.item()


def routing(model: nn.Module) -> Callable[[dict[str, torch.Tensor]], Any]:
    """The window statistic's function: this micro-batch's routing counts."""

    def fn(micro: dict[str, torch.Tensor]) -> Any:
        out = forward(model, micro)
        return fb.moe.router_counts(
            out.router_logits, top_k=TOP_K, attention_mask=micro["attention_mask"]
        )

    return fn


def exact_share(model: nn.Module, window: Any, counts: Any, micro: dict[str, torch.Tensor]) -> Any:
    """One micro-batch's share of the window objective (CE / window tokens + coef · aux term)."""
    out = forward(model, micro)
    ce, _ = fb.causal_lm_loss(out.logits, micro["labels"])
    aux = fb.moe.load_balancing(out.router_logits, counts, attention_mask=micro["attention_mask"])
    return ce / window.totals["tokens"] + COEF * aux


def tokens() -> dict[str, Callable[[Any], Any]]:
    return {"tokens": lambda m: fb.count_tokens(m["labels"])}


def update(before: Sequence[torch.Tensor], model: nn.Module) -> list[torch.Tensor]:
    """SGD(lr=1): the applied gradient is the parameter change."""
    return [b - p.detach() for b, p in zip(before, model.parameters(), strict=True)]


def rel_err(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> float:
    num = sum(((g - w) ** 2).sum() for g, w in zip(got, want, strict=True)) ** 0.5
    den = sum((w**2).sum() for w in want) ** 0.5
    return float(num / den)


def _collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def trainer_step(
    model: nn.Module, trainer_cls: Any, out_dir: str, lengths: Sequence[int], **kw: Any
) -> list[torch.Tensor]:
    """One optimizer step of a ``transformers.Trainer`` class (SGD lr=1, no clipping, 2 rows
    per micro-batch, ``len(lengths) / 2 / world`` micro-batches per window) over
    :func:`moe_rows` ``(lengths, seed=1)``; the parameter change (the applied gradient)."""
    import transformers

    window = moe_rows(lengths, seed=1)
    data = [{k: v[i] for k, v in window.items()} for i in range(len(lengths))]
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    args = transformers.TrainingArguments(
        out_dir,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=len(lengths) // (2 * world),
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
    assert trainer.accelerator.num_processes == world
    return update(before, model)


def trainer_rank(rank: int, world: int, lengths: Sequence[int]) -> list[torch.Tensor]:
    """One rank of the ExactTrainer MoE DDP test (the gloo group is up: tests/_dist.py)."""
    import os
    import tempfile

    import fullbatch.hf

    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="1",  # never used: accelerate finds the process group initialized
        OMP_NUM_THREADS="1",
    )
    model = make_moe("mixtral")
    model.config.output_router_logits = True
    with tempfile.TemporaryDirectory() as out:
        return trainer_step(model, fullbatch.hf.ExactTrainer, out, lengths, loss="causal_lm")

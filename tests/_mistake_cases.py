"""Helpers for the migration-mistake tests of issue 26 (``tests/mistakes/``): a tiny Llama from
a config (float64), right-padded windows, the plain full-batch reference and one fullbatch
step whose SGD(lr=1) update *is* the gradient it applied."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import fullbatch as fb

PAD, IGNORE, VOCAB = 0, -100, 64
LENGTHS = (24, 5, 17, 9, 21, 6, 13, 11)

Batch = dict[str, torch.Tensor]


def tiny_llama(pad_token_id: int | None = PAD, eos_token_id: int | None = None) -> nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        pad_token_id=pad_token_id, eos_token_id=eos_token_id, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).double()


def window(lengths: Sequence[int] = LENGTHS, seed: int = 0, pad: int = PAD) -> Batch:
    """Right-padded rows of real tokens (ids 3..63), labels -100 on padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((len(lengths), max(lengths)), pad)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(3, VOCAB, (n,), generator=g)
        mask[row, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORE)}


def logits(model: nn.Module, micro: Batch) -> torch.Tensor:
    if "attention_mask" in micro:
        return model(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"]).logits
    return model(input_ids=micro["input_ids"]).logits


def loss(model: nn.Module, micro: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The correct form: summed next-token loss and its count."""
    return fb.causal_lm_loss(logits(model, micro), micro["labels"])


def flat_grad(model: nn.Module, value: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    value.backward()
    out = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return out


def full_batch_grad(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Plain PyTorch reference: one forward of the whole batch, mean cross-entropy, backward."""
    out = logits(model, batch)[:, :-1]
    labels = batch["labels"][:, 1:]
    mean = F.cross_entropy(out.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)
    return flat_grad(model, mean)


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def one_step(
    model: nn.Module,
    loader: Iterable[Any],
    body: Callable[[Any, Any], None],
    **acc_kwargs: Any,
) -> tuple[torch.Tensor, fb.StepStats]:
    """The first window through fullbatch with SGD(lr=1): the update, and the window's stats.

    ``body(window, micro)`` is the user's loop body (forward and ``window.backward``).
    """
    before = flat(model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with fb.Accumulator(model, opt, **acc_kwargs) as acc:
        for win in acc.windows(loader):
            for micro in win:
                body(win, micro)
            stats = win.step()
            break
    return before - flat(model), stats


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()))

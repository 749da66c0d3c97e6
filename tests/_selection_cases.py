"""A window-level selection (M2PO-style): the tokens whose importance statistic is in the top
fraction of the *window* (all micro-batches, all ranks) are masked out of a policy-gradient
loss, and the loss is the mean over the tokens kept. Chosen per micro-batch, the selection
(and the gradient) changes with the split (AReaL#1730); chosen once per window with
``window.stats(..., reduce="cat")`` it does not.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

FRACTION = 0.25  # the share of the window's tokens masked out


def old_logprobs(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A fixed behaviour policy's log-probabilities of the labels (data, not model)."""
    g = torch.Generator().manual_seed(int(batch["seed"]))
    return -torch.rand(batch["targets"].shape, generator=g, dtype=torch.float64) * 3


def token_logprobs(model: nn.Module, micro: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(micro["input_ids"]).log_softmax(-1)
    labels = micro["targets"].clamp(min=0)
    return logits.gather(-1, labels[..., None])[..., 0]


def importance(model: nn.Module, micro: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per real token: the squared log importance ratio (what M2PO bounds), 1-D."""
    with torch.no_grad():
        ratio = token_logprobs(model, micro) - micro["old"]
    return (ratio**2)[micro["targets"] != -100]


def threshold(values: torch.Tensor, fraction: float = FRACTION) -> torch.Tensor:
    """The smallest value masked: the ``ceil(fraction · n)``-th largest of the window."""
    k = max(1, math.ceil(fraction * values.numel()))
    return torch.topk(values, k).values[-1]


def loss_sum(model: nn.Module, micro: dict[str, torch.Tensor], limit: torch.Tensor) -> Any:
    """``(Σ over kept tokens of -A · ratio, kept tokens)`` for this micro-batch."""
    logp = token_logprobs(model, micro)
    real = micro["targets"] != -100
    with torch.no_grad():
        stat = (logp - micro["old"]) ** 2
    keep = real & (stat < limit)
    ratio = torch.exp(logp - micro["old"])
    per_token = -micro["advantages"][:, None] * ratio
    return (per_token * keep).sum(), keep.sum()


def with_old(batch: dict[str, torch.Tensor], seed: int) -> dict[str, Any]:
    """``batch`` with a behaviour policy and advantages; ``labels`` become ``targets`` (the
    token at each position is scored, no causal shift)."""
    out: dict[str, Any] = {k: v for k, v in batch.items() if k != "labels"}
    out["targets"] = batch["labels"]
    out["seed"] = torch.tensor(seed)
    out["old"] = old_logprobs(out)
    g = torch.Generator().manual_seed(seed + 1)
    out["advantages"] = torch.randn(out["targets"].shape[0], generator=g, dtype=torch.float64)
    return out


def take(batch: dict[str, Any], start: int, stop: int) -> dict[str, Any]:
    return {k: v if v.dim() == 0 else v[start:stop] for k, v in batch.items()}


def cut(batch: dict[str, Any], sizes: list[int]) -> list[dict[str, Any]]:
    out, start = [], 0
    for size in sizes:
        out.append(take(batch, start, start + size))
        start += size
    return out


def reference(model: nn.Module, batch: dict[str, Any]) -> tuple[list[torch.Tensor], int]:
    """Full batch: the selection over the whole window, then one mean loss and backward."""
    model.zero_grad(set_to_none=True)
    limit = threshold(importance(model, batch))
    total, kept = loss_sum(model, batch, limit)
    (total / kept).backward()
    grads = [
        p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()
    ]
    model.zero_grad(set_to_none=True)
    return grads, int(kept)


def train(model: nn.Module, acc: Any, micros: list[dict[str, Any]]) -> tuple[Any, float]:
    """One window with the selection taken once over the window; (stats, threshold)."""
    for window in acc.windows(micros):
        values = window.stats(lambda m: importance(model, m), reduce="cat")
        limit = threshold(values)
        for micro in window:
            window.backward(*loss_sum(model, micro, limit))
        return window.step(), float(limit)
    raise AssertionError("no window")

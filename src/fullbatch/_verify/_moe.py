"""``fb.verify(model, batch, None, micro_batch_size=M, moe=True)``: the MoE load-balancing
loss under accumulation on the user's own transformers MoE model, each choice measured.

The objective is the model's own on one full batch: the token-mean cross-entropy plus
``router_aux_loss_coef`` times the load-balancing loss of the whole batch (every layer
pooled, ``attention_mask`` respected, top-k). Three ways to accumulate it, each compared with
that full batch on a float64 copy (docs/moe.md):

- ``exact (window.stats)``: fullbatch's Accumulator with the routing counts of the window;
- ``running mean (Megatron-Core, torchtitan#4772)``: micro-batch k balances with the counts of
  micro-batches 1..k, its own probabilities, the mean over micro-batches;
- ``per micro-batch (stock)``: each micro-batch balances its own tokens (what a forward
  computes), the mean over micro-batches.

The cross-entropy is exact in all three (the window's token mean), so the errors are the aux
loss's alone. ``passed``: the exact choice within ``rtol`` (1e-10 by default).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fullbatch._base._losses import causal_lm_loss, count_tokens
from fullbatch._base._moe import load_balancing, router_counts
from fullbatch._base._split import split_rows
from fullbatch._engine._accumulator import Accumulator
from fullbatch._verify._recorder import GradientRecorder

__all__ = ["CHOICES", "MoEReport", "verify_moe"]

EXACT = "exact (window.stats)"
RUNNING = "running mean (Megatron-Core, torchtitan#4772)"
STOCK = "per micro-batch (stock)"
CHOICES = (EXACT, RUNNING, STOCK)


@dataclass(frozen=True)
class MoEReport:
    """What ``fb.verify(..., moe=True)`` found.

    Attributes:
        passed: the exact choice's gradient within ``rtol`` of the full batch's.
        errors: per choice, ``‖g - g*‖ / ‖g*‖`` against the full batch (float64).
        rtol: the tolerance the exact choice is held to.
        micro_batches: how many micro-batches the batch was cut into.
    """

    passed: bool
    errors: dict[str, float]
    rtol: float
    micro_batches: int

    def __str__(self) -> str:
        verdict = "PASSED" if self.passed else "FAILED"
        lines = [
            f"fb.verify (MoE load balancing, {self.micro_batches} micro-batches, float64): "
            f"{verdict}; gradient error of each choice against the full batch:"
        ]
        lines += [f"  {name}: {error:.1e}" for name, error in self.errors.items()]
        return "\n".join(lines)


def _settings(model: nn.Module) -> tuple[int, float]:
    config = getattr(model, "config", None)
    k = getattr(config, "num_experts_per_tok", None)
    coef = getattr(config, "router_aux_loss_coef", None)
    if not isinstance(k, int) or not isinstance(coef, int | float):
        raise ValueError(
            f"verify(..., moe=True) needs a transformers MoE model whose config has "
            f"num_experts_per_tok and router_aux_loss_coef (got {k!r} and {coef!r})."
        )
    return k, float(coef)


def _forward(model: nn.Module, micro: dict[str, Any]) -> Any:
    return model(
        input_ids=micro["input_ids"],
        attention_mask=micro.get("attention_mask"),
        output_router_logits=True,
    )


def _routed(model: nn.Module, micro: dict[str, Any], k: int) -> tuple[Any, dict[str, torch.Tensor]]:
    """A forward, and the routing counts of its real tokens (``fb.moe.router_counts``)."""
    out = _forward(model, micro)
    mask = micro.get("attention_mask")
    return out, router_counts(out.router_logits, top_k=k, attention_mask=mask)


def _grads(model: nn.Module) -> list[torch.Tensor]:
    out = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


def _error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    num = sum(float(((g - w) ** 2).sum()) for g, w in zip(got, want, strict=True)) ** 0.5
    den = sum(float((w**2).sum()) for w in want) ** 0.5
    return num / den


def _full_batch(work: nn.Module, batch: dict[str, Any], k: int, coef: float) -> list[torch.Tensor]:
    out, counts = _routed(work, batch, k)
    ce, n = causal_lm_loss(out.logits, batch["labels"])
    aux = load_balancing(out.router_logits, counts, attention_mask=batch.get("attention_mask"))
    (ce / n + coef * aux).backward()
    return _grads(work)


def _exact(work: nn.Module, micros: list[Any], k: int, coef: float) -> list[torch.Tensor]:
    recorder = GradientRecorder(work.parameters())
    tokens = {"tokens": lambda m: count_tokens(m["labels"])}
    acc = Accumulator(work, recorder, micro_batches=len(micros), counts=tokens)

    with acc:
        for window in acc.windows(micros):
            counts = window.stats(lambda m: _routed(work, m, k)[1])
            for m in window:
                out = _forward(work, m)
                ce, _ = causal_lm_loss(out.logits, m["labels"])
                mask = m.get("attention_mask")
                aux = load_balancing(out.router_logits, counts, attention_mask=mask)
                window.backward(ce / window.totals["tokens"] + coef * aux)
            window.step()
    assert recorder.recorded is not None
    return [
        torch.zeros_like(p) if g is None else g
        for p, g in zip(work.parameters(), recorder.recorded, strict=True)
    ]


def _approximate(
    work: nn.Module, micros: list[Any], k: int, coef: float, running: bool
) -> list[torch.Tensor]:
    """Exact CE; the mean over micro-batches of an aux loss balanced on its own or running
    counts (plain autograd: these are the recipes other engines use)."""
    tokens = sum(float(count_tokens(m["labels"])) for m in micros)
    total: dict[str, torch.Tensor] | None = None
    for m in micros:
        out, own = _routed(work, m, k)
        ce, _ = causal_lm_loss(out.logits, m["labels"])
        if running:
            total = own if total is None else {key: total[key] + own[key] for key in own}
        counts = total if running and total is not None else own
        aux = load_balancing(out.router_logits, counts, attention_mask=m.get("attention_mask"))
        (ce / tokens + coef * aux / len(micros)).backward()
    return _grads(work)


def verify_moe(
    model: nn.Module, batch: Any, *, micro_batch_size: int, rtol: float | None = None
) -> MoEReport:
    """The body of ``fb.verify(..., moe=True)`` (see the module docstring)."""
    if not isinstance(batch, dict) or "input_ids" not in batch or "labels" not in batch:
        raise ValueError(
            "verify(..., moe=True) takes a batch dict with input_ids, labels and (optionally) "
            "attention_mask, as a transformers causal LM takes it."
        )
    k, coef = _settings(model)
    work = copy.deepcopy(model).to(torch.float64)
    work.eval()  # no dropout, no router jitter: the comparison is deterministic
    work.zero_grad(set_to_none=True)
    micros = split_rows(batch, micro_batch_size)
    if len(micros) < 2:
        raise ValueError(
            f"micro_batch_size={micro_batch_size} leaves one micro-batch: nothing is accumulated."
        )
    with torch.enable_grad():
        want = _full_batch(work, batch, k, coef)
        errors = {
            EXACT: _error(_exact(work, micros, k, coef), want),
            RUNNING: _error(_approximate(work, micros, k, coef, running=True), want),
            STOCK: _error(_approximate(work, micros, k, coef, running=False), want),
        }
    tol = 1e-10 if rtol is None else rtol
    return MoEReport(errors[EXACT] <= tol, errors, tol, len(micros))

"""A diagnosis: the MoE load-balancing loss taken per micro-batch instead of over the window.

A transformers MoE model with ``output_router_logits`` adds ``coef · E · Σ_i f_i · P_i`` per
forward; under accumulation each micro-batch then balances against its own routing counts,
not the window's: "a window statistic taken per micro-batch" (docs/moe.md). Given the
window's micro-batches, the applied gradient and the reference (the full window's objective,
its aux term over the window), :func:`window_statistic_per_micro_batch` measures how much of
the error that explains: the share of the error's squared norm in the span of the
per-micro-batch aux gradient ``Σ_k ∇ coef·LB(k; k's counts)`` and the window's
``∇ coef·LB(window)`` (a least-squares factor on each, so ``loss / GA`` and the Trainer's
undivided aux are both covered). A judge input: it names nothing below :data:`NAMED_SHARE`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fullbatch._base._moe import load_balancing, moe_aux_of, router_counts
from fullbatch._base._rng import RngState

__all__ = ["NAMED", "NAMED_SHARE", "StatisticError", "window_statistic_per_micro_batch"]

NAMED = "a window statistic taken per micro-batch"
#: The least share of the error the per-micro-batch statistic must explain to be named.
NAMED_SHARE = 0.5


@dataclass(frozen=True)
class StatisticError:
    """What the per-micro-batch load-balancing loss explains of a window's error."""

    share: float  # of the error's squared norm, in [0, 1]
    coef: float  # the model's router_aux_loss_coef

    @property
    def named(self) -> bool:
        return self.share >= NAMED_SHARE

    def sentence(self) -> str:
        return (
            f"{NAMED}: the MoE load-balancing loss (router_aux_loss_coef={self.coef:g}) was "
            f"computed per micro-batch, against its own routing counts, not the window's; it "
            f"explains {self.share:.0%} of the error. Use the window's counts "
            "(fullbatch.hf.ExactTrainer, or window.stats with fb.moe; docs/moe.md)."
        )


def _aux_grads(
    model: torch.nn.Module, micro_batches: Sequence[dict[str, Any]], coef: float, top_k: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(Σ_k ∇ coef·LB(k; own counts), ∇ coef·LB(window))``, flattened per micro-batch pass."""
    params = [p for p in model.parameters() if p.requires_grad]
    outs = []
    for micro in micro_batches:
        given = {k: v for k, v in micro.items() if k not in ("labels", "shift_labels")}
        outs.append((model(**given, output_router_logits=True).router_logits, micro))
    counts = [
        router_counts(logits, top_k=top_k, attention_mask=m.get("attention_mask"))
        for logits, m in outs
    ]
    window = {k: torch.stack([c[k] for c in counts]).sum(0) for k in ("experts", "rows")}
    own = sum(
        load_balancing(logits, c, attention_mask=m.get("attention_mask"))
        for (logits, m), c in zip(outs, counts, strict=True)
    )
    whole = sum(
        load_balancing(logits, window, attention_mask=m.get("attention_mask")) for logits, m in outs
    )
    assert isinstance(own, torch.Tensor) and isinstance(whole, torch.Tensor)
    g_own = torch.autograd.grad(coef * own, params, retain_graph=True, allow_unused=True)
    g_win = torch.autograd.grad(coef * whole, params, allow_unused=True)

    def flat(gs: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
        return [torch.zeros_like(p) if g is None else g for g, p in zip(gs, params, strict=True)]

    return flat(g_own), flat(g_win)


def _vector(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors])


def window_statistic_per_micro_batch(
    model: torch.nn.Module,
    micro_batches: Sequence[dict[str, Any]],
    applied: Sequence[torch.Tensor],
    reference: Sequence[torch.Tensor],
    *,
    tolerance: float = 1e-6,
) -> StatisticError | None:
    """What share of ``applied - reference`` the per-micro-batch load-balancing loss explains.

    Args:
        model: the model (a transformers MoE model; anything else gives ``None``).
        micro_batches: the window's micro-batches, the model's keyword inputs.
        applied, reference: the gradient applied and the full window's, per trainable
            parameter in ``model.parameters()`` order.
        tolerance: an error below ``tolerance · |reference|`` is no error (rounding).

    Returns:
        ``None`` for a model without an enabled router aux loss or a window without error;
        otherwise the share (``.named`` when it is at least :data:`NAMED_SHARE`). The RNG state
        is put back; no ``.grad`` is touched.
    """
    aux = moe_aux_of(model)
    if aux is None or not micro_batches:
        return None
    error = _vector(applied) - _vector(reference)
    if float(error.norm()) <= tolerance * float(_vector(reference).norm()):
        return None
    rng = RngState()
    try:
        g_own, g_win = _aux_grads(model, micro_batches, aux.coef, aux.top_k)
    finally:
        rng.restore()
    basis = torch.stack([_vector(g_own), _vector(g_win)], dim=1)
    fit = torch.linalg.lstsq(basis, error[:, None]).solution
    explained = basis @ fit[:, 0]
    share = float((explained.norm() / error.norm()) ** 2)
    return StatisticError(min(max(share, 0.0), 1.0), aux.coef)

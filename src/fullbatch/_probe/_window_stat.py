"""A diagnosis: the MoE load-balancing loss taken per micro-batch instead of over the window.

In the probe (:func:`decompose`, on a ``causal_lm+moe`` or ``dpo+moe`` window's sampled
coordinates): the applied gradient is fitted jointly on each micro-batch's cross-entropy (or
DPO) gradient, the leftover, and the two aux gradients ``own = Σ_k ∇A_k(k's counts)`` and
``win = Σ_k ∇A_k(window's counts)`` (``A = coef · load_balancing``:
:mod:`fullbatch._probe._moe_objective`). With ``α``
the weight found on ``own``, the statistic's error is ``α · (own − win)``: what the loop
would have applied with the window's counts instead, the weights unchanged. Its share is
``‖α (own − win)‖² / ‖applied − reference‖²``; the cross-entropy part of the applied gradient
(``applied − α own − β win``) goes to the weight fit, so a mean of per-micro-batch means in the
same loop is named as well. A right window has ``α = 0`` and ``β = 1``.

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

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fullbatch._base._moe import load_balancing, moe_aux_of, router_counts
from fullbatch._base._rng import RngState

__all__ = [
    "NAMED", "NAMED_SHARE", "StatisticError", "decompose", "window_statistic_per_micro_batch",
    "with_statistic",
]  # fmt: skip

NAMED = "a window statistic taken per micro-batch"
#: The least share of the error the per-micro-batch statistic must explain to be named.
NAMED_SHARE = 0.5


@dataclass(frozen=True)
class StatisticError:
    """What the per-micro-batch load-balancing loss explains of a window's error."""

    share: float  # of the error's squared norm, in [0, 1]
    coef: float  # the model's router_aux_loss_coef
    error: float = math.nan  # ‖α (own − win)‖ / ‖reference‖ (decompose: sampled coordinates)
    weight: float = math.nan  # the aux term's weight α + β in the applied gradient (1: right)
    own: float = math.nan  # α: the weight on the per-micro-batch (own counts) aux gradient

    @property
    def named(self) -> bool:
        return self.share >= NAMED_SHARE

    def said(self) -> str:
        """The probe's sentence (its fix is the judge's, :mod:`fullbatch._probe._fixes`)."""
        return (
            f"{NAMED}: the MoE load-balancing loss (router_aux_loss_coef={self.coef:g}) was "
            f"computed per micro-batch, against each micro-batch's own routing counts, not the "
            f"window's (weight {self.own:.3g} on the per-micro-batch term); it explains "
            f"{self.share:.0%} of the error (error {self.error:.2g} from it alone)"
        )

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


def decompose(
    samples: torch.Tensor, applied: torch.Tensor, leftover: torch.Tensor | None,
    own: torch.Tensor, win: torch.Tensor, count: float, coef: float,
) -> tuple[StatisticError, torch.Tensor]:  # fmt: skip
    """The statistic's share of a window's error, and the applied gradient's cross-entropy part.

    Args:
        samples: ``[K, m]`` each micro-batch's sampled cross-entropy gradient (summed loss).
        applied: ``[m]`` the sampled applied gradient; ``leftover``: the gradient present
            before the window (None or zeros: none).
        own, win: ``[m]`` the sampled aux gradients with each micro-batch's own counts and with
            the window's, summed over micro-batches (and ranks).
        count: ``N``; ``coef``: the model's ``router_aux_loss_coef``.

    Returns:
        ``(statistic, applied − α own − β win)`` (module docstring).

    >>> ce = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]], dtype=torch.float64)
    >>> own = torch.tensor([0.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    >>> win = torch.tensor([0.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    >>> stat, rest = decompose(ce, ce.sum(0) / 2 + own, None, own, win, 2.0, 0.1)
    >>> round(stat.share, 6), round(stat.own, 6), round(stat.weight, 6)
    (1.0, 1.0, 1.0)
    >>> rest.round(decimals=6).tolist()  # the cross-entropy's part: the window's mean
    [0.5, 0.5, 0.0, 0.0]
    """
    a = applied.double()
    columns = [samples[i].double() for i in range(samples.shape[0])]
    if leftover is not None and bool(leftover.abs().sum() > 0):
        columns.append(leftover.double())
    columns += [own.double(), win.double()]
    norms = torch.stack([c.norm() for c in columns]).clamp_min(torch.finfo(torch.float64).tiny)
    matrix = torch.stack(columns, dim=1) / norms
    solution = torch.linalg.pinv(matrix) @ a / norms
    alpha, beta = float(solution[-2]), float(solution[-1])
    stat = alpha * (own.double() - win.double())
    reference = samples.double().sum(0) / count + win.double()
    error = a - reference
    e2, r = float(error @ error), float(reference.norm())
    share = min(max(float(stat @ stat) / e2, 0.0), 1.0) if e2 > 0 else 0.0
    found = StatisticError(
        share, coef, error=float(stat.norm()) / r if r > 0 else 0.0, weight=alpha + beta,
        own=alpha,
    )  # fmt: skip
    return found, a - alpha * own.double() - beta * win.double()


def with_statistic(
    stat: StatisticError, patterns: tuple[str, ...], text: str
) -> tuple[str, str, tuple[str, ...]]:
    """The judge's ``(pattern, sentence, patterns)`` for a wrong MoE window whose statistic is
    off: :data:`NAMED` first where it explains at least :data:`NAMED_SHARE` of the error (alone
    where the rest was a bare "loss differs": the weights were fitted on the cross-entropy
    alone, so they are right), else after what the weights show.

    >>> stat = StatisticError(0.9, 0.25, error=0.1, weight=1.0, own=1.0)
    >>> with_statistic(stat, ("loss differs",), "...")[2]
    ('a window statistic taken per micro-batch',)
    """
    said = stat.said()
    if stat.named and patterns[0] == "loss differs":
        return NAMED, said, (NAMED,)
    if stat.named:
        return NAMED, f"{said}; and {text}", (NAMED, *patterns)
    return patterns[0], f"{text}; and {said}", (*patterns, NAMED)

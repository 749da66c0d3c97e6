"""The objective of a transformers MoE model: the window's cross-entropy plus its load balancing.

A model whose forward adds a router aux loss (``output_router_logits`` and a nonzero
``router_aux_loss_coef``: :func:`fullbatch._base._moe.moe_aux_of`) trains, on one full batch,
``CE_sum / N + coef · LB(window)``: the token-mean cross-entropy and transformers'
``load_balancing_loss_func`` over the whole window (all layers pooled, ``attention_mask``
respected, top-k). That is the probe's objective :data:`MOE` (``"causal_lm+moe"``): inferred for
such a model (``objective=None``), or declared; ``objective="causal_lm"`` declares the aux off.

``LB(window)`` takes its routing counts from every micro-batch of the window and rank, so the
reference needs them before the first replay: :func:`prepare` runs a no-grad pre-pass over
the window's recorded calls (each from its own RNG state), sums ``fb.moe.router_counts`` and the
item count ``N`` over the ranks, and returns the per-call objective ``CE_k + N · coef ·
load_balancing(k, window counts)`` (the terms sum to ``N`` times the full batch's loss, as
``fullbatch.hf.ExactTrainer`` computes it: one source, :mod:`fullbatch._base._moe`). It also
takes, on the sampled coordinates, each call's aux gradient with the window's counts and with
its own (the stock per-micro-batch loss): the columns the judge's diagnosis fits
(:mod:`fullbatch._probe._window_stat`, "a window statistic taken per micro-batch").

A callable objective whose loss adds the window's load balancing too (TRL's DPO on a MoE model:
:mod:`fullbatch.trl._objective`) declares it with a :class:`Routed` as its ``routed``
attribute: the same pre-pass and aux columns run on its own routing forward and item count,
and the objective is the one it binds to the window's counts and ``N``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fullbatch._base._moe import MoeAux, load_balancing, moe_aux_of, router_counts
from fullbatch._base._rng import RngState
from fullbatch._base._routing import window_row
from fullbatch._base._sync._probe import sum_tensors
from fullbatch._probe._call_loss import LOSS_ONLY, ObjectiveFn, resolve
from fullbatch._probe._capture import Call
from fullbatch._probe._replay import grads_of, replaying
from fullbatch._probe._sample import Sampler
from fullbatch._proof._objective import logits_of, objective_count, objective_loss, unwrapped

__all__ = ["MOE", "MoeWindow", "Routed", "aux_of", "moe_kind", "prepare", "routed_of"]

#: The objective of a transformers MoE model with its router aux loss on.
MOE = "causal_lm+moe"


#: A call's routing forward: ``(router logits, attention mask, the model's outputs)``.
Forward = Callable[[Call], tuple[Any, torch.Tensor | None, Any]]
#: A callable objective ``fn(model, micro) -> (loss_sum, count)``, as the user declares one.
MicroObjective = Callable[[nn.Module, Any], tuple[torch.Tensor, float]]


@dataclass(frozen=True)
class Routed:
    """A callable objective's declaration (its ``routed`` attribute) that its loss adds
    ``coef · load_balancing`` over the window's routing, as a transformers MoE model does.

    Attributes:
        aux: the coefficient and top-k of the load-balancing loss, asked when the window is
            judged (at its step: a trainer may zero its coefficient inside its own loss, as
            ``fullbatch.trl.ExactDPOTrainer`` does to weight TRL's per-micro-batch term).
        forward: ``(model, micro) -> (router logits, attention mask, outputs)``, the forward
            whose routing the loss balances (run without and with gradient).
        items: ``micro -> its count``, the objective's ``N`` unit.
        bind: ``(window counts, N) -> fn(model, micro) -> (loss_sum, count)``: the objective
            with ``N · coef · load_balancing(its router logits, the window's counts)`` added.
    """

    aux: Callable[[], MoeAux]
    forward: Callable[[nn.Module, Any], tuple[Any, torch.Tensor | None, Any]]
    items: Callable[[Any], float]
    bind: Callable[[dict[str, torch.Tensor], float], MicroObjective]


def routed_of(objective: Any) -> Routed | None:
    """The :class:`Routed` a callable objective declares, or None."""
    routed = getattr(objective, "routed", None) if callable(objective) else None
    return routed if isinstance(routed, Routed) else None


def aux_of(module: nn.Module) -> MoeAux | None:
    """The router aux loss ``module`` (or the model in a known wrapper) adds, or None."""
    return moe_aux_of(unwrapped(module))


def moe_kind(kind: str, module: nn.Module, *, declared: bool) -> str:
    """The objective to judge ``module`` under: an inferred (or trainer-given) ``"causal_lm"``
    becomes :data:`MOE` on a model that adds a router aux loss; a declared :data:`MOE` on one
    that adds none is refused (naming the config and the fix); anything else is ``kind``.

    >>> moe_kind("causal_lm", nn.Linear(1, 1), declared=False)
    'causal_lm'
    """
    aux = aux_of(module)
    if kind == MOE and aux is None:
        raise ValueError(
            f"objective={MOE!r}: {type(unwrapped(module)).__name__} adds no router aux loss "
            "(its config needs output_router_logits=True and a nonzero router_aux_loss_coef); "
            "declare objective='causal_lm' for its cross-entropy alone."
        )
    if kind == "causal_lm" and aux is not None and not declared:
        return MOE
    return kind


@dataclass
class MoeWindow:
    """A MoE window's routing and its aux gradients on the sampled coordinates (this rank).

    Attributes:
        aux: the model's ``router_aux_loss_coef`` and top-k.
        counts: the window's routing counts over every micro-batch and rank.
        items: ``N``, the window's cross-entropy item count over every rank.
        win: per call, the sampled ``∇ coef · load_balancing(k, window counts)``.
        own: ``Σ_k`` the sampled ``∇ coef · load_balancing(k, k's own counts)``: the stock
            per-micro-batch aux loss's gradient.
    """

    aux: MoeAux
    counts: dict[str, torch.Tensor]
    items: float
    win: list[torch.Tensor] = field(default_factory=list)
    own: torch.Tensor | None = None

    def cross_entropy(self, samples: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each call's sampled ``∇CE_k`` from its sampled ``∇S_k = ∇CE_k + N ∇A_k(window)``."""
        return [s - self.items * w for s, w in zip(samples, self.win, strict=True)]


def _given(call: Call) -> dict[str, Any]:
    kwargs = {k: v for k, v in call.kwargs.items() if k not in LOSS_ONLY}
    return {**kwargs, "output_router_logits": True}


def _router_logits(out: Any) -> Any:
    logits = getattr(out, "router_logits", None)
    if logits is None:
        raise ValueError(
            f"objective={MOE!r}: the model returned no router_logits with "
            "output_router_logits=True; declare objective='causal_lm' (the aux loss off) or "
            "objective=fn(model, micro) -> (loss_sum, count)."
        )
    return logits


def _labels(call: Call) -> tuple[torch.Tensor, bool]:
    labels, shifted = call.labels()
    if labels is None:
        raise ValueError(
            f"objective={MOE!r} needs labels, but the model received none and none were found "
            "around its call; pass them to the model or declare objective=fn(model, micro)."
        )
    return labels, shifted


def _experts(module: nn.Module) -> int:
    """The model's experts per layer, from its config (Mixtral's ``num_local_experts``,
    Qwen3-MoE's and OLMoE's ``num_experts``)."""
    config = getattr(unwrapped(module), "config", None)
    text = (
        config.get_text_config()
        if config is not None and hasattr(config, "get_text_config")
        else config
    )
    for name in ("num_local_experts", "num_experts"):
        value = getattr(text, name, None)
        if isinstance(value, int):
            return value
    raise ValueError(
        f"objective={MOE!r}: {type(unwrapped(module)).__name__}'s config names no number of "
        "experts (num_local_experts or num_experts); declare objective=fn(model, micro)."
    )


def _lm_forward(call: Call) -> tuple[Any, torch.Tensor | None, Any]:
    """``causal_lm+moe``'s routing forward: the call as recorded, its router logits asked for."""
    with replaying(call):
        out = call.module(*call.args, **_given(call))
    return _router_logits(out), call.kwargs.get("attention_mask"), out


def _lm_items(call: Call, out: Any) -> float:
    labels, shifted = _labels(call)
    return objective_count("causal_lm", labels, shifted=shifted)


def _declared(routed: Routed) -> tuple[Forward, Callable[[Call, Any], float]]:
    """A :class:`Routed` objective's routing forward and item count on a recorded call (its
    micro-batch as the objective receives it: ``call.user_micro()``)."""

    def forward(call: Call) -> tuple[Any, torch.Tensor | None, Any]:
        with replaying(call):
            return routed.forward(call.module, call.user_micro())

    return forward, lambda call, out: routed.items(call.user_micro())


def _routing(
    calls: list[Call], aux: MoeAux, sync: Any, forward: Forward,
    items: Callable[[Call, Any], float],
) -> tuple[dict[str, torch.Tensor], float]:  # fmt: skip
    """The pre-pass (:func:`fullbatch._base._routing.window_row`): every call's routing counts
    (``forward``: from its call's RNG state) and ``items``, summed over the window and ranks in
    one reduction (the RNG put back after), on CPU. A rank whose pre-pass fails still joins
    the reduction, flagged, and every rank then raises."""

    def summed(total: torch.Tensor) -> torch.Tensor:
        if sync.world > 1:  # on the device of the inputs, as the collective needs
            ids = calls[0].kwargs.get("input_ids")
            total = total.to(ids.device if isinstance(ids, torch.Tensor) else "cpu")
            sum_tensors([total], sync.group)
        return total.cpu()

    experts = _experts(calls[0].module)
    total = window_row(calls, forward, items, top_k=aux.top_k, summed=summed, experts=experts)
    if total.failed is not None and total.failed > 0:
        raise RuntimeError(f"objective={MOE!r}: the routing pre-pass failed on another rank.")
    return total.counts, float(total.items)


def _reaching(out: Any) -> torch.Tensor:
    """Zero, through the model's logits: an aux-only backward then also enters every layer from
    its output, where FSDP2 and ZeRO-3 gather the layer's parameters for its backward (the
    router logits reach a layer's gate past that hook, and the gate's weight is freed)."""
    return (logits_of(out) * 0.0).sum()


def _aux_columns(
    window: MoeWindow, calls: list[Call], forward: Forward, targets: list[Any],
    sampler: Sampler, pick: list[int], whole: Callable[[list[Any]], list[Any]],
) -> None:  # fmt: skip
    """Each call's sampled aux gradient with the window's counts, and their sum with each
    call's own counts: two forwards per call, one ``torch.autograd.grad`` each (no ``.grad``).
    Never one graph differentiated twice: FSDP2 and ZeRO-3 free the parameters they gathered
    for a backward after it, so a retained graph would point at freed storage."""
    coef, top_k, own = window.aux.coef, window.aux.top_k, None
    rng = RngState()
    try:
        with torch.enable_grad():
            for call in calls:
                for mine in (True, False):
                    logits, mask, out = forward(call)
                    counts = (
                        router_counts(logits, top_k=top_k, attention_mask=mask)
                        if mine
                        else window.counts
                    )
                    lb = coef * load_balancing(logits, counts, attention_mask=mask)
                    grads = whole(grads_of(lb + _reaching(out), targets))
                    taken = sampler.take([grads[j] for j in pick])
                    if mine:
                        own = taken if own is None else own + taken
                    else:
                        window.win.append(taken)
    finally:
        rng.restore()
    window.own = own


def prepare(
    calls: list[Call], sync: Any, sampler: Sampler, params: list[Any], targets: list[Any],
    whole: Callable[[list[Any]], list[Any]] | None = None, routed: Routed | None = None,
) -> tuple[ObjectiveFn, MoeWindow]:  # fmt: skip
    """The window's objective on each recorded call, and its :class:`MoeWindow` (module
    docstring). ``params``: the reference's parameters (the sampler's are among them);
    ``targets``: what to differentiate in their place; ``whole``: what makes gradients whole;
    ``routed``: a callable objective's declaration (else ``causal_lm+moe``)."""
    aux = aux_of(calls[0].module) if routed is None else routed.aux()
    if aux is None:
        raise ValueError(moe_kind(MOE, calls[0].module, declared=True))  # raises, naming why
    forward, count_of = (_lm_forward, _lm_items) if routed is None else _declared(routed)
    counts, items = _routing(calls, aux, sync, forward, count_of)
    window = MoeWindow(aux, counts, items)
    where = {id(p): i for i, p in enumerate(params)}
    pick = [where[id(p)] for p in sampler.params]
    _aux_columns(window, calls, forward, targets, sampler, pick, whole or (lambda g: g))
    if routed is not None:  # the declared objective, bound to the window's routing
        return resolve(routed.bind(counts, items), calls[0].module)[1], window

    def objective(module: nn.Module, call: Call) -> tuple[torch.Tensor, float]:
        labels, shifted = _labels(call)
        out = module(*call.args, **_given(call))
        loss_sum, count = objective_loss("causal_lm", logits_of(out), labels, shifted=shifted)
        lb = load_balancing(_router_logits(out), counts,
                            attention_mask=call.kwargs.get("attention_mask"))  # fmt: skip
        return loss_sum + (items * aux.coef) * lb.to(loss_sum.dtype), float(count)

    return objective, window

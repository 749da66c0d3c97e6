"""The MoE load-balancing loss of a transformers model, exact over an ``ExactTrainer`` window.

A transformers MoE model (Mixtral, Qwen3-MoE, OLMoE) whose config has
``output_router_logits=True`` adds ``router_aux_loss_coef · E · Σ_i f_i · P_i`` to its loss,
computed per forward: under accumulation, per micro-batch. Here the routing counts ``f`` are
the window's: a no-grad pre-pass over the window's micro-batches (RNG restored) takes
``fb.moe.router_counts`` and the window's item count ``N``, summed over the ranks in one
reduction, and each micro-batch's loss sum gains ``N · coef · load_balancing(its router
logits, the window's counts)``; divided by ``N`` at the window's close, the step is the full
batch's (docs/moe.md, "Hugging Face Trainer"). The model's own loss is never used
(``ExactTrainer`` withholds the labels), so its per-micro-batch aux term is not added twice.
``fullbatch.trl.ExactSFTTrainer`` uses the same pre-pass; TRL's fused LM head returns no router
logits, so :func:`router_logits_of` reads them off the backbone with a forward hook.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from fullbatch._base._moe import MoeAux, load_balancing, moe_aux_of
from fullbatch._base._routing import window_row

__all__ = ["MoeAux", "WindowRouting", "moe_aux_of", "router_logits_of", "window_routing"]


@dataclass(frozen=True)
class WindowRouting:
    """The window's routing counts (``fb.moe.router_counts`` over every micro-batch and rank)
    and its item count ``N``: the constants every micro-batch's aux term uses; ``seconds``
    is the pre-pass's time on this rank (its reduction included)."""

    aux: MoeAux
    counts: dict[str, torch.Tensor]
    items: float
    seconds: float = 0.0

    def term(self, outputs: Any, inputs: dict[str, Any]) -> torch.Tensor:
        """``N · coef · load_balancing``: this micro-batch's aux term as a share of the loss
        *sum* the window divides by ``N``."""
        logits = getattr(outputs, "router_logits", None)
        if logits is None:
            raise ValueError(
                "the model returned no router_logits although its config has "
                "output_router_logits=True; ExactTrainer needs them for the load-balancing loss."
            )
        return self.term_of(logits, inputs.get("attention_mask"))

    def term_of(self, router_logits: Any, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """:meth:`term` from the router logits themselves (a forward that does not return
        them: :func:`router_logits_of`)."""
        lb = load_balancing(router_logits, self.counts, attention_mask=attention_mask)
        return lb * (self.items * self.aux.coef)


def _backbone(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers backbone a causal LM's forward calls (``base_model``; under PEFT, that
    of the model PEFT wraps): its output carries ``router_logits``."""
    unwrap = getattr(model, "get_base_model", None)
    inner = unwrap() if callable(unwrap) else model
    backbone = getattr(inner, "base_model", None)
    if not isinstance(backbone, torch.nn.Module) or backbone is inner:
        raise ValueError(
            f"{type(inner).__name__} has no backbone module (base_model) whose output carries "
            "router_logits; the window's load-balancing loss needs them. Set "
            "router_aux_loss_coef=0.0 to train without it."
        )
    return backbone


@contextmanager
def router_logits_of(model: torch.nn.Module) -> Iterator[list[Any]]:
    """The router logits of every forward of ``model``'s backbone inside the block (with their
    gradient), for a forward that computes them but returns something else (TRL's fused LM
    head returns per-token log-probabilities). A forward hook, removed on exit: the user's
    model and its code are unchanged."""
    seen: list[Any] = []

    def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        logits = getattr(output, "router_logits", None)
        if logits is not None:
            seen.append(logits)

    handle = _backbone(model).register_forward_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


def window_routing(
    aux: MoeAux,
    model: torch.nn.Module,
    micro_batches: list[dict[str, Any]],
    count: Callable[[dict[str, Any], Any], float],
    summed: Callable[[torch.Tensor], torch.Tensor] | None,
) -> WindowRouting:
    """The pre-pass: a no-grad forward of every micro-batch (labels withheld), its router
    counts and ``count(inputs, outputs)`` items, summed over the window and (``summed``) the
    ranks in one reduction (:func:`fullbatch._base._routing.window_row`). The RNG state is put
    back, so the training forwards draw the dropout masks they would draw without it."""

    def forward(inputs: dict[str, Any]) -> tuple[Any, torch.Tensor | None, Any]:
        given = {k: v for k, v in inputs.items() if k not in ("labels", "shift_labels")}
        outputs = model(**given, output_router_logits=True)
        return outputs.router_logits, inputs.get("attention_mask"), outputs

    start = time.perf_counter()
    total = window_row(micro_batches, forward, count, top_k=aux.top_k, summed=summed)
    items = float(total.items.item())  # a host read: the time includes the reduction
    return WindowRouting(aux, total.counts, items, time.perf_counter() - start)

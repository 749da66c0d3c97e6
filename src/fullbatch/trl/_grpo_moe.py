"""The MoE load-balancing loss of ``ExactGRPOTrainer``, taken over the window, not per micro-batch.

TRL 1.16's GRPO loss adds ``router_aux_loss_coef · aux / gradient_accumulation_steps`` per
micro-batch, ``aux`` being transformers' pooled load-balancing loss of that micro-batch's one
forward (prompt + completion, ``attention_mask`` = prompt and completion masks, top-k): the
mean over the window of each micro-batch's loss. On one full batch (every sequence of the
window in one micro-batch, on one rank) it is the load-balancing loss of all those sequences:
that is the objective here. A no-grad pre-pass over the window's prepared micro-batches
(:func:`fullbatch.hf._moe.window_routing`, RNG restored, under TRL's autocast) sums the routing
counts over the window and ranks; each micro-batch's term is
``load_balancing(its router logits, the window's counts)``, and the window's terms (all
micro-batches and ranks) sum to the full batch's loss and gradient (docs/moe.md, "TRL").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fullbatch._base._moe import MoeAux, load_balancing
from fullbatch.hf._moe import WindowRouting, router_logits_of, window_routing

__all__ = ["grpo_aux", "grpo_routing", "routed_forward"]

# prepared-input keys TRL passes to the model besides ids and mask (vision-language models)
_EXTRA_INPUTS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_attention_mask",
    "spatial_shapes",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


def grpo_aux(trainer: Any) -> MoeAux | None:
    """The router aux loss TRL's GRPO adds (its ``aux_loss_enabled`` and coefficient), with the
    model's experts per token; ``None`` when TRL adds none."""
    if not getattr(trainer, "aux_loss_enabled", False):
        return None
    coef = float(trainer.router_aux_loss_coef)
    model = trainer.accelerator.unwrap_model(trainer.model)
    text = model.config.get_text_config()
    top_k = getattr(text, "num_experts_per_tok", None)
    if not isinstance(top_k, int):
        raise ValueError(
            f"ExactGRPOTrainer: router_aux_loss_coef={coef} on {type(model).__name__}, whose "
            f"config has num_experts_per_tok={top_k!r}; the window's load-balancing loss needs "
            "the experts per token (an int). Set router_aux_loss_coef=0.0 in the GRPOConfig to "
            "train without it."
        )
    return MoeAux(coef, top_k)


def _model_inputs(inputs: dict[str, Any]) -> dict[str, Any]:
    """What TRL's ``_compute_loss`` gives the model for one micro-batch (one chunk)."""
    extra = sorted(k for k in _EXTRA_INPUTS if inputs.get(k) is not None)
    if extra:
        raise ValueError(
            f"ExactGRPOTrainer takes the MoE load-balancing loss over the window for text-only "
            f"models; this micro-batch carries {extra}. Set router_aux_loss_coef=0.0 in the "
            "GRPOConfig to train without it, or use trl.GRPOTrainer (its aux loss per "
            "micro-batch)."
        )
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    # the router runs on every token; the head on one position is enough (no vocab-wide logits)
    return {"input_ids": ids, "attention_mask": mask, "logits_to_keep": 1}


def grpo_routing(
    aux: MoeAux,
    model: torch.nn.Module,
    prepared: list[dict[str, Any]],
    summed: Callable[[torch.Tensor], torch.Tensor] | None,
    autocast: Any,
) -> WindowRouting:
    """The window's routing counts over its prepared micro-batches and (``summed``) the ranks,
    from one no-grad forward each under ``autocast`` (TRL's, so the router picks the experts
    the training forward picks); ``items`` is the window's sequences."""
    micro = [_model_inputs(inputs) for inputs in prepared]
    with autocast:
        return window_routing(aux, model, micro, _rows, summed)


def _rows(inputs: dict[str, Any], outputs: Any) -> float:
    return float(inputs["input_ids"].shape[0])


def routed_forward(
    routing: WindowRouting,
    model: torch.nn.Module,
    attention_mask: torch.Tensor,
    forward: Callable[[], tuple[Any, Any, Any]],
) -> tuple[Any, Any, torch.Tensor]:
    """TRL's ``forward`` of one micro-batch (log-probabilities, entropies, its aux loss) with
    the aux loss replaced by this micro-batch's term of the window's load-balancing loss (with
    its gradient; summed over the window's micro-batches and ranks, the full batch's loss).
    TRL's fused head returns no router logits: a hook on ``model``'s backbone reads them."""
    with router_logits_of(model) as seen:
        logps, entropies, _ = forward()
    if len(seen) != 1:
        raise ValueError(
            f"the forward's backbone returned router_logits {len(seen)} times, expected once "
            "(one forward per micro-batch); ExactGRPOTrainer needs them for the window's "
            "load-balancing loss. Set router_aux_loss_coef=0.0 in the GRPOConfig to train "
            "without it."
        )
    term = load_balancing(seen[0], routing.counts, attention_mask=attention_mask)
    return logps, entropies, term

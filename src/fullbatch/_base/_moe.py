"""The MoE load-balancing loss as a window statistic: ``E · Σ_i f_i · P_i`` over a window.

The Switch/GShard load-balancing loss, as transformers' Mixtral, Qwen3-MoE and OLMoE define
it on one batch: every layer's router logits pooled, padding (``attention_mask`` 0) left
out, top-k routing. ``f_i`` is the share of top-k assignments that went to expert ``i`` and
``P_i`` the mean router probability of expert ``i``, both over (rows × layers)::

    loss = E · Σ_i (C_i / R) · (Q_i / R)

with ``C_i`` the top-k assignments to expert ``i``, ``Q_i`` the summed probabilities and
``R`` the routed rows, each summed over the batch and the layers. ``C`` and ``R`` carry no
gradient, so over a window the loss is a sum of micro-batch terms once ``C`` and ``R`` are
the window's: :func:`router_counts` gives them for ``window.stats``, and
:func:`load_balancing` is one micro-batch's term. Summed over the window's micro-batches
and ranks it is the full batch's loss, and so is its gradient (docs/moe.md).
:func:`moe_aux_of` reads whether a transformers model adds the loss itself
(``output_router_logits`` and ``router_aux_loss_coef``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["MoeAux", "load_balancing", "moe_aux_of", "router_counts"]


def _layers(router_logits: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    layers = [router_logits] if isinstance(router_logits, torch.Tensor) else list(router_logits)
    if not layers or any(t.dim() != 2 for t in layers):
        shapes = [tuple(t.shape) for t in layers]
        raise ValueError(
            f"router_logits: got layers of shapes {shapes}; pass the model's router logits, "
            "one [rows, experts] tensor per layer (e.g. `out.router_logits` of a transformers "
            "MoE model called with output_router_logits=True)."
        )
    return layers


def _mask(attention_mask: torch.Tensor | None, rows: int, like: torch.Tensor) -> torch.Tensor:
    if attention_mask is None:
        return torch.ones(rows, dtype=like.dtype, device=like.device)
    flat = attention_mask.reshape(-1).to(like.device, like.dtype)
    if flat.numel() != rows:
        raise ValueError(
            f"attention_mask has {flat.numel()} entries but the router logits have {rows} rows "
            "per layer; pass the attention_mask of the same forward (batch x sequence)."
        )
    return flat


def _dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def router_counts(
    router_logits: torch.Tensor | Sequence[torch.Tensor],
    *,
    top_k: int,
    attention_mask: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """One micro-batch's routing counts: the window statistic of the load-balancing loss.

    Args:
        router_logits: one ``[rows, experts]`` tensor per layer (``out.router_logits``).
        top_k: experts per token (``config.num_experts_per_tok``).
        attention_mask: ``[batch, sequence]`` (1 real, 0 padding), as given to the model.

    Returns:
        ``{"experts": [E] top-k assignments per expert, "rows": routed rows}``, both summed
        over layers and weighted by ``attention_mask`` (float64, no gradient). Pass the
        function that returns it to ``window.stats`` to sum it over the window and ranks.

    >>> logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 1.0, 2.0]])
    >>> c = router_counts([logits, logits], top_k=1)
    >>> c["experts"].tolist(), c["rows"].item()
    ([2.0, 0.0, 2.0], 4.0)
    """
    layers = _layers(router_logits)
    experts = layers[0].shape[-1]
    if not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise ValueError(f"top_k={top_k!r}: give an int from 1 to the {experts} experts.")
    first = layers[0].detach()
    counts = torch.zeros(experts, dtype=torch.float64, device=first.device)
    rows = torch.zeros((), dtype=torch.float64, device=first.device)
    mask = _mask(attention_mask, first.shape[0], counts)
    for layer in layers:
        probs = torch.softmax(layer.detach().to(first.device), dim=-1)
        chosen = torch.topk(probs, top_k, dim=-1).indices.reshape(-1)
        counts = counts.scatter_add(0, chosen, mask.repeat_interleave(top_k))
        rows = rows + mask.sum()
    return {"experts": counts, "rows": rows}


def load_balancing(
    router_logits: torch.Tensor | Sequence[torch.Tensor],
    counts: dict[str, torch.Tensor],
    *,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """This micro-batch's term of the load-balancing loss of the window ``counts`` describe.

    ``E · Σ_i (C_i / R) · (Q_i / R)`` with ``C`` and ``R`` from ``counts`` (constants) and
    ``Q`` this micro-batch's router probabilities summed over its rows and layers (with
    gradient). With the window's counts (``window.stats``), the terms of all micro-batches
    and ranks sum to the full batch's loss; with this micro-batch's own
    :func:`router_counts`, it is the stock per-micro-batch loss.

    Returns:
        A 0-dim tensor in ``promote_types(logits.dtype, float32)``; multiply it by the
        model's ``router_aux_loss_coef`` and add it to the micro-batch's share of the loss.

    >>> logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 1.0, 2.0]])
    >>> window = router_counts(logits, top_k=1)
    >>> halves = load_balancing(logits[:1], window) + load_balancing(logits[1:], window)
    >>> torch.allclose(halves, load_balancing(logits, window))
    True
    """
    layers = _layers(router_logits)
    dtype = _dtype(layers[0])
    experts, rows = counts["experts"], counts["rows"]
    if experts.shape != (layers[0].shape[-1],):
        raise ValueError(
            f"counts['experts'] has shape {tuple(experts.shape)} but the router logits have "
            f"{layers[0].shape[-1]} experts; pass the window's router_counts of this model."
        )
    device = layers[0].device
    mask = _mask(attention_mask, layers[0].shape[0], torch.empty((), dtype=dtype, device=device))
    probs = torch.stack(
        [(torch.softmax(t.to(device, dtype), dim=-1) * mask[:, None]).sum(0) for t in layers]
    ).sum(0)
    rows = rows.to(device, dtype)
    share = experts.to(device, dtype) / rows
    return experts.shape[0] * (share * probs).sum() / rows


@dataclass(frozen=True)
class MoeAux:
    """A model's enabled router auxiliary loss: its weight and experts per token."""

    coef: float
    top_k: int


def moe_aux_of(model: torch.nn.Module) -> MoeAux | None:
    """The router aux loss the model adds to its own loss (``output_router_logits`` on and a
    nonzero ``router_aux_loss_coef``), or ``None``."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    coef = float(getattr(text, "router_aux_loss_coef", 0.0) or 0.0)
    if not getattr(text, "output_router_logits", False) or coef == 0.0:
        return None
    top_k = getattr(text, "num_experts_per_tok", None)
    if not isinstance(top_k, int):
        raise ValueError(
            f"{type(model).__name__} has router_aux_loss_coef={coef} and output_router_logits "
            f"but num_experts_per_tok={top_k!r}; the load-balancing loss needs the experts "
            "per token."
        )
    return MoeAux(coef, top_k)

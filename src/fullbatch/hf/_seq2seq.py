"""Encoder-decoder heads (T5, BART) for ``ExactTrainer(loss="seq2seq")``.

Their labels are the decoder's targets, aligned with its outputs (no shift); the decoder's
inputs are the labels shifted right, which the model builds itself only when it receives
``labels``. ExactTrainer withholds the labels (it computes the loss), so it builds
``decoder_input_ids`` here the way the model does (``prepare_decoder_input_ids_from_labels``).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["check_kind", "with_decoder_inputs"]


def is_encoder_decoder(model: Any) -> bool:
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))


def check_kind(kind: str, model: Any) -> None:
    """Refuse a token loss kind that does not fit the model's architecture.

    >>> check_kind("causal_lm", torch.nn.Linear(1, 1))
    """
    name = type(model).__name__
    if is_encoder_decoder(model) and kind in ("causal_lm", "token"):
        raise ValueError(
            f"loss={kind!r} does not fit {name}, an encoder-decoder: its labels are the "
            "decoder's targets, aligned with its outputs, and it needs decoder_input_ids built "
            "from them; pass loss='seq2seq'."
        )
    if kind == "seq2seq" and not is_encoder_decoder(model):
        raise ValueError(
            f"loss='seq2seq' is for encoder-decoder models (T5, BART); {name} is not one. "
            "A decoder-only LM: pass loss='causal_lm'."
        )


def with_decoder_inputs(model: Any, inputs: dict[str, Any], labels: torch.Tensor) -> dict:
    """``inputs`` with ``decoder_input_ids`` built from ``labels`` as the model builds them
    (kept when the batch has them already)."""
    if "decoder_input_ids" in inputs or "decoder_inputs_embeds" in inputs:
        return inputs
    unwrapped = getattr(model, "module", model)
    build = getattr(unwrapped, "prepare_decoder_input_ids_from_labels", None)
    if build is None:
        raise ValueError(
            f"{type(unwrapped).__name__} has no prepare_decoder_input_ids_from_labels: make the "
            "data collator return 'decoder_input_ids' (the labels shifted right)."
        )
    return {**inputs, "decoder_input_ids": build(labels=labels)}

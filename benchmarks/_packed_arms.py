"""The packed arms of ``benchmarks/split.py`` (``micro_batch_tokens=T, pack=True``).

- transformers' own attention (``sdpa``): on a packed row without a cache, transformers builds
  a block-diagonal mask from ``position_ids``. On CPU that mask is dense, ``n x n`` for a
  packed row of ``n`` tokens: packing saves the padding but computes every cross-row score and
  masks it away.
- ``per_row``: an attention registered with transformers' ``AttentionInterface`` that cuts the
  packed row at ``cu_seq_lens_q`` and runs one causal ``scaled_dot_product_attention`` per row
  (right-padded batches: one call per row on its real tokens). It computes only the scores a
  row needs, like flash-attention's varlen kernel does on a GPU, with one call per row.
- ``flash_attention_2`` (CUDA only, when the ``flash_attn`` package imports): the varlen kernel
  itself, reading ``cu_seq_lens_q/k`` and ``max_length_q/k`` from the micro-batch.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["packed_scores", "register_per_row", "scores_needed"]


def _per_row_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``query``: ``[batch, heads, q, dim]``; returns ``[batch, q, heads, dim]``."""
    batch, heads, q_len, _ = query.shape
    out = query.new_zeros(batch, q_len, heads, value.shape[-1])
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:  # one packed row: cut at the row boundaries
        bounds = cu.tolist()
        spans = [(0, a, b) for a, b in itertools.pairwise(bounds)]
    elif attention_mask is not None and attention_mask.dim() == 2:  # right padding
        spans = [(r, 0, int(n)) for r, n in enumerate(attention_mask.sum(1).tolist())]
    else:
        spans = [(r, 0, q_len) for r in range(batch)]
    for r, a, b in spans:
        if b <= a:
            continue
        got = F.scaled_dot_product_attention(
            query[r : r + 1, :, a:b],
            key[r : r + 1, :, a:b],
            value[r : r + 1, :, a:b],
            is_causal=True,
            scale=scaling,
            enable_gqa=key.shape[1] != heads,
        )
        out[r, a:b] = got[0].transpose(0, 1)
    return out, None


def register_per_row() -> str:
    """Register ``"per_row"`` with transformers; returns the name to give ``attn_implementation``.

    The mask function is flash-attention's: ``None`` for a packed row (the attention reads
    ``cu_seq_lens_q``), the 2-D padding mask otherwise.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    AttentionInterface.register("per_row", _per_row_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register("per_row", flash_attention_mask)
    return "per_row"


def scores_needed(lengths: list[int]) -> int:
    """Attention scores a window needs (per head and layer): each row attends to itself."""
    return sum(n * n for n in lengths)


def packed_scores(micro: dict[str, Any], per_row: bool) -> int:
    """Scores one packed micro-batch computes: ``n^2`` with a dense block mask, ``sum l_i^2``
    per row."""
    if "cu_seq_lens_q" not in micro:  # the packing check's padded rows (first window only)
        rows, width = micro["input_ids"].shape
        return rows * width * width
    cu = micro["cu_seq_lens_q"].tolist()
    if per_row:
        return sum((b - a) ** 2 for a, b in itertools.pairwise(cu))
    return int(cu[-1]) ** 2

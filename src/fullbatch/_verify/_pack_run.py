"""``fb.verify(model, batch, loss_fn, micro_batch_tokens=T, pack=True)``: does packing respect
the row boundaries on the user's own model? See :mod:`fullbatch._base._row_boundaries`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fullbatch._base._losses import causal_lm_loss
from fullbatch._base._modelstate import ModelSnapshot, disable_dropout
from fullbatch._base._packed import RowPacker
from fullbatch._base._row_boundaries import PackingReport, check_packed
from fullbatch._base._sort_trim import Lengths
from fullbatch._verify._load import _logits
from fullbatch._verify._precision import working_copy

__all__ = ["packed_loss_fn", "verify_packing"]


def verify_packing(
    model: nn.Module,
    batch: Any,
    loss_fn: Any,
    *,
    micro_batch_tokens: Any,
    dtype: torch.dtype | None = None,
    lengths: Lengths = "attention_mask",
) -> PackingReport:
    """The body of ``fb.verify(..., pack=True)``; the model is left exactly as it was.

    >>> import torch, fullbatch as fb
    >>> class PerToken(torch.nn.Module):  # no attention: packing is trivially exact
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.embed, self.out = torch.nn.Embedding(9, 4), torch.nn.Linear(4, 9)
    ...     def forward(self, input_ids, position_ids=None, **kwargs):
    ...         return self.out(self.embed(input_ids))
    >>> mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    >>> batch = {"input_ids": mask * 3, "attention_mask": mask, "labels": mask * 3}
    >>> def loss_fn(model, micro):
    ...     logits = model(**{k: v for k, v in micro.items() if k != "labels"})
    ...     return fb.causal_lm_loss(logits, micro["labels"])
    >>> fb.verify(PerToken().double(), batch, loss_fn, micro_batch_tokens=8, pack=True).passed
    True
    """
    if isinstance(micro_batch_tokens, bool) or not isinstance(micro_batch_tokens, int):
        raise ValueError(
            f"verify(pack=True) needs micro_batch_tokens=T, an integer >= 2 (real tokens per "
            f"packed micro-batch), got {micro_batch_tokens!r}."
        )
    if not callable(loss_fn):
        raise TypeError(
            f"loss_fn must be callable as loss_fn(model, micro) -> (loss_sum, count), got "
            f"{type(loss_fn).__name__}."
        )
    notes: list[str] = []
    snapshot = ModelSnapshot.capture(model)
    dropout = None
    try:
        with torch.enable_grad():
            work, work_batch, _ = working_copy(model, batch, dtype, notes)
            dropout = disable_dropout(work)
            micros = RowPacker(micro_batch_tokens=micro_batch_tokens, lengths=lengths)(work_batch)
            report = check_packed(work, lambda micro: loss_fn(work, micro), micros)
    finally:
        if dropout is not None:
            dropout.restore()
        snapshot.restore()
    if report is None:
        raise ValueError(
            f"every packed micro-batch of micro_batch_tokens={micro_batch_tokens} holds one "
            "row: nothing can cross a row boundary, so the check would prove nothing. Pass a "
            "larger micro_batch_tokens (at least the two shortest rows together)."
        )
    extra = tuple(notes) + tuple(
        f"disabled for the comparison: {line}" for line in dropout.describe()
    )
    return PackingReport(
        report.passed,
        report.grad_error,
        report.band,
        report.tolerance,
        report.leak,
        report.causes,
        report.notes + extra,
    )


def packed_loss_fn(model: nn.Module, micro: Any) -> Any:
    """``fullbatch verify --pack``'s default loss: the documented packed call, every key but
    ``labels`` to the model, then next-token cross-entropy summed over the counted labels."""
    output = model(**{k: v for k, v in micro.items() if k != "labels"})
    return causal_lm_loss(_logits(output, micro["input_ids"]), micro["labels"])

"""Labels and counts that are wrong whatever the loss, told from one micro-batch (issues 18, 26).

:func:`label_mistake` compares a micro-batch's ``labels`` with its ``input_ids`` (and
``attention_mask`` when there is one) and the count passed to ``window.backward``:

- **shifted twice**: labels already shifted (``labels[:, t] == input_ids[:, t + 1]``) counted
  as a shifting loss counts them; or labels aligned with the inputs counted as a loss that
  shifted them *twice* counts them (``logits[:, :-1]``, ``labels[:, 1:]`` copied before
  ``fb.causal_lm_loss``: only the labels from column 2 are counted);
- **padding counted**: labels counted where ``attention_mask`` is 0 at that position and the
  one before; without a mask, where ``input_ids`` holds the model's pad id
  (``model.config.pad_token_id``, or its ``eos_token_id`` that tokenizers often pad with) at
  that position and the one before, inside the run of pad ids that ends the row (right
  padding) or starts it (left padding). A single end-of-sequence target right after the text
  is fine either way;
- **unshifted count**: labels a copy of ``input_ids`` counted without the shift (warned: a loss
  that reconstructs its own input would be legitimate).

A count that matches none of the forms (another ``ignore_index``, weights, rows) is left alone.

:class:`LabelCheck` runs it on the first two backward calls with a count (a mistake in the data
pipeline shows in every micro-batch), then drops out of the watch list: its reads of the
labels are the only host syncs of the first window's micro-batches, one Accumulator's once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from fullbatch._base._warn import warn
from fullbatch._engine._state import WindowState
from fullbatch._engine._watch import Watch

__all__ = ["LabelCheck", "label_mistake", "pad_token_ids"]

#: backward calls (of the first window) whose labels and count are checked
_LABEL_CHECKS = 2


def pad_token_ids(model: nn.Module) -> tuple[int, ...]:
    """The ids a Hugging Face model's config pads with: ``pad_token_id``, ``eos_token_id``.

    >>> class Config:
    ...     pad_token_id, eos_token_id = None, [2, 7]
    >>> model = torch.nn.Linear(1, 1)
    >>> model.config = Config()
    >>> pad_token_ids(model), pad_token_ids(torch.nn.Linear(1, 1))
    ((2, 7), ())
    """
    inner = getattr(model, "module", model)  # DDP
    config = getattr(inner, "config", None)
    ids: list[int] = []
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(config, name, None)
        values = value if isinstance(value, (list, tuple)) else [value]
        ids += [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0]
    return tuple(dict.fromkeys(ids))


def _pad_runs(ids: torch.Tensor, pad: int) -> torch.Tensor:
    """``[rows, T - 1]``: position t >= 1 and t - 1 both in the pad run ending or starting a row."""
    is_pad = ids == pad
    trailing = is_pad.flip(1).cummin(1).values.flip(1)  # pad from here to the row's end
    leading = is_pad.cummin(1).values  # pad from the row's start to here
    return trailing[:, :-1] | leading[:, 1:]


def _padding_counted(
    labels: torch.Tensor, ids: Any, mask: Any, pad_ids: tuple[int, ...], n: float
) -> str | None:
    counted = labels != -100
    if isinstance(mask, torch.Tensor) and mask.shape == labels.shape:
        both = (mask[:, 1:] == 0) & (mask[:, :-1] == 0)
        padded = int((counted[:, 1:] & both).sum())
        if padded:
            return (
                f"labels are counted where attention_mask is 0 ({padded} padding positions "
                f"in a count of {n:g}; padding labelled with the pad id instead of -100?), so "
                "the loss trains the model to predict padding. Set "
                "`labels = input_ids.masked_fill(attention_mask == 0, -100)`, or pass "
                "ignore_index=pad_id to the loss."
            )
        return None
    if not isinstance(ids, torch.Tensor) or ids.shape != labels.shape:
        return None
    for pad_id in pad_ids:
        on_pad = int((counted[:, 1:] & _pad_runs(ids, pad_id)).sum())
        if on_pad:
            return (
                f"labels are counted on padding: {on_pad} positions in a count of {n:g} hold "
                f"the pad id {pad_id} (from model.config) in input_ids, after another pad id at "
                "the end (or start) of their row, and the batch has no attention_mask to tell "
                "padding apart. The loss would train the model to predict padding. Label "
                "padding with -100: have the collator return attention_mask and set "
                "`labels = input_ids.masked_fill(attention_mask == 0, -100)` (or use a "
                "collator that does, e.g. DataCollatorForLanguageModeling(tokenizer, "
                "mlm=False))."
            )
    return None


def label_mistake(
    micro: Mapping[str, Any], count: Any, pad_ids: tuple[int, ...] = ()
) -> str | None:
    """The message for labels and count that are wrong whatever the loss, else ``None``.

    ``pad_ids``: the model's pad ids, used when the micro-batch has no ``attention_mask``.

    >>> ids = torch.tensor([[5, 6, 7, 8, 0, 0, 0]])
    >>> mask = (ids != 0).long()
    >>> labels = ids.masked_fill(mask == 0, -100)
    >>> label_mistake({"input_ids": ids, "attention_mask": mask, "labels": labels}, 3) is None
    True
    >>> print(label_mistake({"input_ids": ids, "attention_mask": mask, "labels": ids}, 6))
    labels are counted where attention_mask is 0 ...
    >>> print(label_mistake({"input_ids": ids, "labels": ids}, 6, pad_ids=(0,)))
    labels are counted on padding: 2 positions in a count of 6 hold the pad id 0 ...
    """
    labels, ids, mask = micro.get("labels"), micro.get("input_ids"), micro.get("attention_mask")
    if not isinstance(labels, torch.Tensor) or labels.dim() != 2 or labels.shape[1] < 2:
        return None
    if labels.is_floating_point():
        return None
    try:
        n = float(count)
    except (TypeError, ValueError, RuntimeError):
        return None
    counted = labels != -100
    unshifted, shifted = float(counted.sum()), float(counted[:, 1:].sum())
    twice = float(counted[:, 2:].sum())
    masked = float(mask.sum()) if isinstance(mask, torch.Tensor) else None
    if n <= 0 or n not in (unshifted, shifted, masked, twice):
        return None  # the loss counts something else (another ignore_index, weights, rows)
    aligned = isinstance(ids, torch.Tensor) and ids.shape == labels.shape
    copied = aligned and bool((labels == ids)[counted].all())  # type: ignore[index]
    if n == twice and n not in (unshifted, shifted, masked):
        if not copied:
            return None
        return (
            f"the count {n:g} is what a loss counts that shifts these labels twice: they are "
            "aligned with input_ids, and only the labels from column 2 on were counted "
            f"({shifted:g} after one causal shift), as when logits[:, :-1] and labels[:, 1:] "
            "go into fb.causal_lm_loss, which shifts them again (every token predicted two "
            "positions ahead). Pass the unshifted tensors, `fb.causal_lm_loss(logits, "
            "micro['labels'])`, or `fb.cross_entropy_sum(logits[:, :-1], labels[:, 1:])`, "
            "which does not shift."
        )
    padding = _padding_counted(labels, ids, mask, pad_ids, n)
    if padding is not None:
        return padding
    if not aligned or not isinstance(ids, torch.Tensor):
        return None
    mid = counted[:, :-1]
    pre_shifted = bool(mid.any()) and bool((labels[:, :-1] == ids[:, 1:])[mid].all())
    if pre_shifted and not copied and n == shifted != unshifted:
        return (
            "labels are already shifted (labels[:, t] == input_ids[:, t + 1]) and the count "
            f"{n:g} is what a loss that shifts them again counts (fb.causal_lm_loss): every "
            "token would be predicted two positions ahead. Pass these labels to "
            "fb.cross_entropy_sum(logits, labels), which does not shift, or pass unshifted "
            "labels (input_ids with -100 on padding) to fb.causal_lm_loss."
        )
    if copied and n in (unshifted, masked) and n != shifted:
        warn(
            f"labels are a copy of input_ids but the count {n:g} includes each row's first "
            f"label, which no position predicts ({shifted:g} after the causal shift; "
            "attention_mask.sum() is not the count). Pass the count fb.causal_lm_loss "
            "returns: `loss_sum, n = fb.causal_lm_loss(logits, labels)`."
        )
    return None


class LabelCheck(Watch):
    """:func:`label_mistake` on the first backward calls with a count, then done."""

    def __init__(self, model: nn.Module) -> None:
        self._pad_ids = pad_token_ids(model)
        self._left = _LABEL_CHECKS
        self._micro: Any = None

    def on_micro_batch(self, state: WindowState, micro: Any) -> None:
        self._micro = micro

    def before_backward(self, state: WindowState, loss: torch.Tensor, count: Any) -> bool:
        if count is None or state.current_padding:
            return False
        self._left -= 1
        micro, self._micro = self._micro, None
        if isinstance(micro, Mapping):
            message = label_mistake(micro, count, self._pad_ids)
            if message is not None:
                raise ValueError(message)
        return self._left == 0

    def close(self) -> None:
        self._micro = None

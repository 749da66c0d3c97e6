"""Migration mistakes that train silently wrong, caught before anything changes (issue 18).

Each check looks for a signature that correct code cannot have:

- **scheduler stepped per micro-batch** (no ``scheduler=``): the learning rate changes
  *between two backward calls of one window*. Setting the LR for the coming step before the
  first backward or after the last one is fine; a change in between means
  ``scheduler.step()`` runs once per micro-batch, decaying K times too fast.
- **labels shifted twice**: ``labels[:, t] == input_ids[:, t + 1]`` (labels already shifted)
  *and* the count is the one a shifting loss (``fb.causal_lm_loss``) gives, not the one of
  those labels as they are: every token is predicted two positions ahead.
- **padding counted**: labels counted where ``attention_mask`` is 0 at that position *and*
  the one before (so neither a shifting nor a non-shifting loss predicts them from a real
  token), *and* the count includes them: padding labelled with the pad id, not ``-100``.
- **unshifted count**: labels a copy of ``input_ids`` (a causal LM), counted without the
  shift: each row's first label, which nothing predicts, is in the count (warned: a loss that
  reconstructs its own input without shifting would be legitimate).
- **share without totals**: ``window.backward(share)`` in a window that never read
  ``window.totals``, so the share cannot have been divided by it (warned).
- **uncollated micro-batch**: with ``micro_batches=K`` a loader item that is a list of per-row
  dicts or tuples is handed to the loop as it is (warned once).
- **optimizer on some parameters**: model parameters that require grad but that the optimizer
  does not hold never train (warned at construction).

The label checks look at the first backward calls of the first window only (a mistake in the
data pipeline shows in every micro-batch), so they cost one host sync per Accumulator.

Not checked here, because a loss value has no unit: a mean-reduced loss passed with its count
(``F.cross_entropy(..., reduction="mean")``, n). ``fb.verify``'s additivity check catches it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from fullbatch._base._split import _is_row_list
from fullbatch._base._warn import warn

__all__ = ["MistakeChecks", "warn_untrained"]

#: backward calls (of the first window) whose labels and count are checked
_LABEL_CHECKS = 2


def warn_untrained(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Warn when some of the model's trainable parameters are not in the optimizer.

    >>> import warnings
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     warn_untrained(model, torch.optim.SGD(model[1].parameters(), lr=0.1))
    >>> print(str(caught[0].message).split(":")[0])
    2 of the model's 4 trainable parameters (0.weight, 0.bias) are not in the optimizer
    """
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    left = [n for n, p in named if id(p) not in stepped]
    if not left or len(left) == len(named):  # none, or all: the latter raises elsewhere
        return
    shown = ", ".join(left[:3]) + (", ..." if len(left) > 3 else "")
    warn(
        f"{len(left)} of the model's {len(named)} trainable parameters ({shown}) are not in "
        "the optimizer: they get gradients but never train. Freeze them "
        "(`p.requires_grad_(False)`) if that is the intent, or build the optimizer from "
        "model.parameters()."
    )


class MistakeChecks:
    """Per-Accumulator state of the checks: what was seen, what was already warned.

    The window calls :meth:`see` when it yields a micro-batch, :meth:`totals_read` when
    ``window.totals`` is read, and :meth:`before_backward` before each backward; an error
    that method returns is raised by the window after it abandoned itself.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, scheduler: Any = None) -> None:
        self._optimizer = optimizer
        self._watch_lr = scheduler is None  # a given scheduler is watched by LoopGuard
        self._label_checks = _LABEL_CHECKS
        self._micro: Any = None
        self._lr_window: Any = None  # the window the learning rates were taken in
        self._lrs: list[Any] | None = None
        self._read_in: Any = None  # the last window whose totals were read
        self._warned: set[str] = set()

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warn(message)

    # -- hooks called by the window ----------------------------------------------------------

    def see(self, micro: Any) -> None:
        """A micro-batch was yielded: keep it for the label checks, flag an uncollated one."""
        self._micro = micro if self._label_checks > 0 else None
        if _is_row_list(micro):
            self._warn_once(
                "rows",
                f"a micro-batch is a list of {len(micro)} per-row records, handed to your loop "
                "as it is (with micro_batches=K each loader item is one micro-batch). Collate "
                "rows in the loader (a DataLoader with batch_size= and a collate_fn that pads, "
                "e.g. DataCollatorWithPadding), or pass whole windows with micro_batch_size=, "
                "which collates rows of equal length.",
            )

    def totals_read(self, window: Any) -> None:
        self._read_in = window

    def before_backward(self, window: Any, count: Any) -> Exception | None:
        """Check one backward call before it changes anything: the error to raise, or None.

        ``window`` is the user's Window (its ``index`` and ``is_padding`` are read).
        """
        error = self._check_lr(window)
        if error is not None:
            return error
        if count is None:
            if self._read_in is not window:
                self._warn_once(
                    "share",
                    "window.backward(share) in a window that never read window.totals: the "
                    "share must be the loss sum divided by a window.totals entry (e.g. "
                    "`window.backward(loss_sum / window.totals['tokens'])`), or each "
                    "micro-batch weighs its own sum (docs/mistakes.md). Or pass the summed "
                    "loss and its count: window.backward(loss_sum, n).",
                )
        elif self._label_checks > 0 and not window.is_padding:
            self._label_checks -= 1
            micro, self._micro = self._micro, None
            if isinstance(micro, Mapping):
                message = label_mistake(micro, count)
                if message is not None:
                    return ValueError(message)
        return None

    def _check_lr(self, window: Any) -> Exception | None:
        if not self._watch_lr:
            return None
        lrs = [_lr(group.get("lr", 0.0)) for group in self._optimizer.param_groups]
        if self._lr_window is not window:
            self._lr_window, self._lrs = window, lrs
            return None
        if lrs != self._lrs:
            return RuntimeError(
                f"the learning rate changed between two backward calls of window "
                f"{window.index} (from {self._lrs} to {lrs}): scheduler.step() once per "
                "micro-batch decays the schedule K times too fast. The window was discarded "
                "and nothing was stepped. Pass scheduler= to the Accumulator (it steps once "
                "per optimizer step) and delete your scheduler.step(), or call it after "
                "window.step()."
            )
        return None


def _lr(value: Any) -> Any:
    """A comparable learning rate; a tensor one by identity and version (no host sync)."""
    if isinstance(value, torch.Tensor):
        return (id(value), value._version)
    return float(value)


def label_mistake(micro: Mapping[str, Any], count: Any) -> str | None:
    """The message for labels and count that are wrong whatever the loss, else ``None``.

    >>> ids = torch.tensor([[5, 6, 7, 8, 0, 0, 0]])
    >>> mask = (ids != 0).long()
    >>> labels = ids.masked_fill(mask == 0, -100)
    >>> label_mistake({"input_ids": ids, "attention_mask": mask, "labels": labels}, 3) is None
    True
    >>> print(label_mistake({"input_ids": ids, "attention_mask": mask, "labels": ids}, 6))
    labels are counted where attention_mask is 0 ...
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
    masked = float(mask.sum()) if isinstance(mask, torch.Tensor) else None
    if n not in (unshifted, shifted, masked):
        return None  # the loss counts something else (another ignore_index, weights, rows)
    if isinstance(mask, torch.Tensor) and mask.shape == labels.shape:
        pad = (mask[:, 1:] == 0) & (mask[:, :-1] == 0)
        padded = int((counted[:, 1:] & pad).sum())
        if padded:
            return (
                f"labels are counted where attention_mask is 0 ({padded} padding positions "
                f"in a count of {n:g}; padding labelled with the pad id instead of -100?), so "
                "the loss trains the model to predict padding. Set "
                "`labels = input_ids.masked_fill(attention_mask == 0, -100)`, or pass "
                "ignore_index=pad_id to the loss."
            )
    if not isinstance(ids, torch.Tensor) or ids.shape != labels.shape:
        return None
    mid = counted[:, :-1]
    pre_shifted = bool(mid.any()) and bool((labels[:, :-1] == ids[:, 1:])[mid].all())
    copied = bool((labels == ids)[counted].all())
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

"""Exact token-mean accumulation inside MosaicML Composer's own ``Trainer``.

With ``Trainer(accumulate_train_batch_on_tokens=True)`` Composer weighs each micro-batch's
loss by its share of the window's tokens, which is exact only when the DataSpec's count and
the loss's count are the same tokens. :class:`TokenCounts` gives both from one place and
checks them against each other. It does not import Composer. See
docs/integrations_frameworks.md ("Composer").

.. code-block:: python

    counts = fullbatch.composer.TokenCounts(shift=True)          # causal LM labels
    spec = DataSpec(loader, get_num_tokens_in_batch=counts)       # the DataSpec's count
    # (or your own count function, checked: get_num_tokens_in_batch=counts.watch(my_count))

    class LM(ComposerModel):
        def loss(self, outputs, batch):
            return counts.loss(outputs.logits, batch)              # {"total": S / n}

    Trainer(..., train_dataloader=spec, accumulate_train_batch_on_tokens=True)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from fullbatch._base._losses import count_tokens, cross_entropy_sum

__all__ = ["TokenCounts"]


class TokenCounts:
    """The DataSpec's token count and the loss's token mean, from the same labels.

    Args:
        labels: the batch key of the labels (``-100`` = not a target).
        shift: ``True`` for causal LM labels aligned with the inputs (the first label of each
            row is not a target; the loss shifts), ``False`` for token targets as they are
            (masked LM, token classification).
        ignore_index: the label that is not a target.
        check: how many micro-batches :meth:`loss` checks (the first ones, i.e. the first
            window and more): the count the DataSpec returned for this very batch must equal
            the loss's. Each check reads the count on the host; ``0`` checks nothing.

    Raises (from :meth:`loss`, while checking):
        ValueError: the DataSpec counted another number of tokens than the loss holds (e.g.
            a count without the shift), naming both.
        RuntimeError: the DataSpec was not asked about this micro-batch just before its
            loss: ``accumulate_train_batch_on_tokens`` is off (Composer then weights
            micro-batches by samples), or the DataSpec does not use this object.

    >>> import torch
    >>> counts = TokenCounts(shift=True)
    >>> batch = {"labels": torch.tensor([[5, 6, 7], [8, -100, -100]])}
    >>> counts(batch)
    {'total': 6, 'loss_generating': 2}
    >>> logits = torch.zeros(2, 3, 10, dtype=torch.float64)
    >>> round(float(counts.loss(logits, batch)["total"]), 4)  # log(10): a token mean
    2.3026
    """

    def __init__(
        self,
        *,
        labels: str = "labels",
        shift: bool = True,
        ignore_index: int = -100,
        check: int = 64,
    ) -> None:
        if not isinstance(shift, bool):
            raise ValueError(f"shift must be True or False, got {shift!r}.")
        if isinstance(check, bool) or not isinstance(check, int) or check < 0:
            raise ValueError(f"check must be an int >= 0, got {check!r}.")
        self.labels = labels
        self.shift = shift
        self.ignore_index = ignore_index
        self.check = check
        self.checked = 0  # micro-batches whose two counts were compared
        self._last: tuple[Any, int] | None = None  # (batch, its loss-generating count)

    # -- the DataSpec side ------------------------------------------------------------------

    def _labels(self, batch: Any) -> torch.Tensor:
        if not isinstance(batch, Mapping) or self.labels not in batch:
            keys = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
            raise ValueError(
                f"TokenCounts(labels={self.labels!r}) found no such key in the batch ({keys}); "
                "pass labels=<the key of your labels>."
            )
        return batch[self.labels]

    def __call__(self, batch: Any) -> dict[str, int]:
        """``get_num_tokens_in_batch`` for Composer's ``DataSpec``: ``"loss_generating"`` is
        the loss's target count (after the shift, without ignored labels), ``"total"`` every
        label position."""
        labels = self._labels(batch)
        n = int(count_tokens(labels, self.ignore_index, self.shift))
        self._remember(batch, n)
        return {"total": int(labels.numel()), "loss_generating": n}

    def watch(self, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """Your own ``get_num_tokens_in_batch``, whose ``"loss_generating"`` count (or its one
        number) :meth:`loss` then checks against the loss's own count."""
        if not callable(fn):
            raise ValueError(f"watch() needs a function of the batch, got {fn!r}.")

        def get_num_tokens_in_batch(batch: Any) -> Any:
            out = fn(batch)
            self._remember(batch, out.get("loss_generating") if isinstance(out, Mapping) else out)
            return out

        return get_num_tokens_in_batch

    def _remember(self, batch: Any, n: Any) -> None:
        if self.checked < self.check:  # only while checking: no batch is kept after that
            self._last = (batch, n)

    # -- the model side ---------------------------------------------------------------------

    def loss(self, logits: torch.Tensor, batch: Any) -> dict[str, torch.Tensor]:
        """``{"total": S / n}`` for ``ComposerModel.loss``: the micro-batch's summed
        cross-entropy ``S`` over its ``n`` target tokens (``0`` when it has none). Composer
        multiplies it by ``n · W / N``. Returned under ``"total"`` so that Composer
        backpropagates it as it is (it sums other losses into a float32 buffer)."""
        labels = self._labels(batch)
        loss_sum, n = cross_entropy_sum(logits, labels, self.ignore_index, shift=self.shift)
        if self.checked < self.check:
            self._compare(batch, int(n))
            self.checked += 1
        return {"total": loss_sum / n.clamp(min=1).to(loss_sum.dtype)}

    def _compare(self, batch: Any, n: int) -> None:
        last, self._last = self._last, None
        if last is None or last[0] is not batch:
            raise RuntimeError(
                "TokenCounts.loss: the DataSpec's get_num_tokens_in_batch was not asked about "
                "this micro-batch before its loss. Build the Trainer with "
                "accumulate_train_batch_on_tokens=True (otherwise Composer weights "
                "micro-batches by samples) and the DataSpec with "
                "get_num_tokens_in_batch=counts (or counts.watch(your_function))."
            )
        counted = last[1]
        if counted is None or float(counted) != n:
            hint = (
                " A count of the labels without the causal shift counts one more per row."
                if self.shift
                else ""
            )
            raise ValueError(
                f"the DataSpec counted {counted} loss-generating tokens in this micro-batch, "
                f"the loss holds {n} (labels={self.labels!r}, shift={self.shift}): Composer "
                f"would weight this micro-batch by {counted}/{n} of its share.{hint} Count "
                "what the loss counts: get_num_tokens_in_batch=counts."
            )

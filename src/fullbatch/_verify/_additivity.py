"""The additivity check: is ``loss_fn`` a sum of per-item terms, and if not, why not?

Accumulation is exact only when the loss of the whole batch is the sum of the losses of its
parts and the counts add up too. Splitting the batch's rows in two halves tests exactly that.
When it fails, the cause is named by testing the usual suspects one at a time:

- train-mode BatchNorm: the check is repeated with BatchNorm in eval mode, and the layers
  ``batchnorm="window"`` makes exact (those not fed by another train-mode BatchNorm) are named;
- a constant count (per-call mean with ``count=1``): accumulation becomes the naive ``loss / K``;
- a mean-reduced loss: the whole batch's value is an average of its halves' values;
- otherwise a coupled loss: rows interact (in-batch negatives, batch statistics).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from fullbatch._base._modelstate import batchnorm_modules
from fullbatch._base._split import count_rows, take_rows
from fullbatch._verify._arms import LossFn, call_loss
from fullbatch._verify._bn import batchnorm_feeds
from fullbatch._verify._report import AdditivityCheck

__all__ = ["check_additivity"]

_SUM_FIX = (
    "return the loss summed over items and the number of items, e.g. "
    "`return fb.cross_entropy_sum(logits, labels)` or `loss.sum(), loss.numel()` for "
    "reduction='none'"
)


def _close(a: float, b: float, tol: float) -> bool:
    return abs(a - b) <= tol * max(abs(a), abs(b), 1e-300)


def _measure(model: nn.Module, batch: Any, loss_fn: LossFn, tol: float) -> AdditivityCheck:
    rows = count_rows(batch)
    half = rows // 2
    with torch.no_grad():
        whole = call_loss(loss_fn, model, batch)
        first = call_loss(loss_fn, model, take_rows(batch, 0, half))
        second = call_loss(loss_fn, model, take_rows(batch, half, rows))
    s, n = float(whole[0]), whole[1]
    (s1, n1), (s2, n2) = (float(first[0]), first[1]), (float(second[0]), second[1])
    scale = max(abs(s), abs(s1) + abs(s2))
    sum_error = abs(s - (s1 + s2)) / scale if scale > 0 else 0.0
    counts_add = _close(n, n1 + n2, tol)
    return AdditivityCheck(
        whole=(s, n),
        halves=((s1, n1), (s2, n2)),
        sum_rel_error=sum_error,
        counts_add=counts_add,
        holds=counts_add and sum_error <= tol,
    )


def _loss_causes(check: AdditivityCheck, tol: float) -> list[str]:
    """Name what breaks additivity when BatchNorm is not (or no longer) the reason."""
    s, n = check.whole
    (s1, n1), (s2, n2) = check.halves
    sums_add = check.sum_rel_error <= tol
    if not all(math.isfinite(v) for v in (s, s1, s2, n, n1, n2)):
        return [
            f"non-finite values: loss sums {s:g} vs {s1:g} + {s2:g}, counts {n:g} vs "
            f"{n1:g} + {n2:g}; fix the loss (or the data) so that it is finite"
        ]
    if not check.counts_add and n == n1 == n2:
        return [
            f"constant count: loss_fn returns count {n:g} for the whole batch and for each half, "
            "so it is a per-call mean and accumulation becomes the naive `loss / K` (a mean of "
            f"micro-batch means, wrong when micro-batches hold different numbers of items); "
            f"{_SUM_FIX}"
        ]
    causes = []
    if not sums_add:
        lo, hi = min(s1, s2), max(s1, s2)
        slack = tol * max(abs(lo), abs(hi), 1e-300)
        if n1 > 0 and n2 > 0 and _close(s * n, s1 * n1 + s2 * n2, tol):
            causes.append(
                f"mean-reduced loss: loss_fn returns the mean over its {n:g} items (the whole "
                f"batch's {s:.6g} is the count-weighted average of its halves' {s1:.6g} and "
                f"{s2:.6g}, not their sum); {_SUM_FIX}"
            )
        elif lo - slack <= s <= hi + slack:
            causes.append(
                f"mean-reduced loss: the whole batch's loss {s:.6g} lies between its halves' "
                f"{s1:.6g} and {s2:.6g} instead of being their sum (e.g. a token mean returned "
                f"with count = rows); {_SUM_FIX}"
            )
        else:
            causes.append(
                f"coupled loss: the whole batch's loss sum {s:.6g} is not the sum of its halves' "
                f"({s1:.6g} + {s2:.6g}) and it is neither a mean nor train-mode BatchNorm, so a "
                "row's loss depends on the other rows in its batch (in-batch negatives, batch "
                "statistics in the loss or the model); accumulating micro-batches cannot "
                "reproduce it. If rows meet only in the loss (contrastive, in-batch "
                "negatives), use `stats = window.run_coupled(encode, loss)`: encode(micro) "
                "returns the representations, loss(reps, rows) scores the whole window's; "
                "otherwise use a loss that is a sum of per-item terms"
            )
    if not check.counts_add:
        causes.append(
            f"counts do not add up: {n:g} for the whole batch but {n1:g} + {n2:g} for its "
            "halves; count must be the number of items the loss sum contains, e.g. "
            "`fb.count_tokens(labels)` or the number of rows"
        )
    return causes


def _names(names: list[str], limit: int = 4) -> str:
    return ", ".join(repr(n) for n in names[:limit]) + (", …" if len(names) > limit else "")


def _batchnorm_cause(bn_names: list[str], first: list[str], fed: list[str]) -> str:
    """What train-mode BatchNorm breaks, and what ``batchnorm='window'`` does and does not fix."""
    total = len(first) + len(fed)
    window = (
        "batchnorm='window' makes running statistics exact only for BatchNorm layers not fed "
        f"by another train-mode BatchNorm: here {_names(first) if first else 'none'} "
        f"({len(first)} of {total}; in a ResNet-18 that is the stem alone)"
    )
    if fed:
        window += f"; the other {len(fed)} ({_names(fed)}) keep approximate statistics"
    return (
        f"train-mode BatchNorm (modules {_names(bn_names)}): it normalizes with the statistics "
        "of the rows it sees, so each micro-batch's gradient depends on which rows share it and "
        "no accumulation gives the full batch's gradient, batchnorm='window' included; "
        f"{window}; for an exact gradient put BatchNorm in eval mode or use "
        "GroupNorm/LayerNorm, or accept an approximate one"
    )


def check_additivity(
    model: nn.Module, batch: Any, loss_fn: LossFn, tol: float
) -> AdditivityCheck | None:
    """Compare ``loss_fn`` on ``batch`` with the sum over its two halves (``None``: one row).

    Forward passes only (no gradients). Train-mode BatchNorm moves running statistics: the
    caller restores buffers.

    >>> import torch, fullbatch as fb
    >>> model = torch.nn.Linear(3, 2)
    >>> batch = {"x": torch.randn(4, 3), "y": torch.tensor([0, 1, 1, 0])}
    >>> good = lambda m, b: fb.cross_entropy_sum(m(b["x"]), b["y"])
    >>> check_additivity(model, batch, good, 1e-5).holds
    True
    >>> mean = lambda m, b: (torch.nn.functional.cross_entropy(m(b["x"]), b["y"]), len(b["y"]))
    >>> check_additivity(model, batch, mean, 1e-5).causes[0].split(":")[0]
    'mean-reduced loss'
    """
    if count_rows(batch) < 2:
        return None
    check = _measure(model, batch, loss_fn, tol)
    if check.holds:
        return check
    bn_names = batchnorm_modules(model)
    causes: list[str] = []
    remaining = check
    if bn_names:
        bn = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        flags = [m.training for m in bn]
        for m in bn:
            m.training = False
        try:
            remaining = _measure(model, batch, loss_fn, tol)
        finally:
            for m, flag in zip(bn, flags, strict=True):
                m.training = flag
        first, fed = batchnorm_feeds(model, lambda: call_loss(loss_fn, model, batch))
        causes.append(
            _batchnorm_cause(bn_names, first, fed)
            + ("" if remaining.holds else "; additivity still fails with it in eval mode:")
        )
    if not remaining.holds:
        causes += _loss_causes(remaining, tol)
    return AdditivityCheck(
        whole=check.whole,
        halves=check.halves,
        sum_rel_error=check.sum_rel_error,
        counts_add=check.counts_add,
        holds=False,
        causes=tuple(causes),
    )

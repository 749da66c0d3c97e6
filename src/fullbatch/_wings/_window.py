"""The one wing window: the numbers of one framework window, as ``WindowState`` is the engine's.

A wing records each micro-batch's ``(loss sum, count, *extras)`` as device tensors (no host
read), may count the window ahead of its first forward (:func:`count_ahead`: DeepSpeed, GRPO,
the pipeline), and closes it with one stack, one reduce and one host read
(:meth:`WingWindow.read`: the sums and the gradients' squared norm together, the bad-count
check on every rank) and the shared verdict (:meth:`WingWindow.close`). The adapter around it
keeps its framework's state only. The contract: docs/wings.md ("Writing a new wing").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fullbatch._base._verdict import Verdict, WindowTotals
from fullbatch._wings._close import Wing, close_window, read_totals

__all__ = ["Ahead", "Read", "Reduce", "WingWindow", "count_ahead"]

Reduce = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Ahead:
    """A window counted before its first forward: ``sums`` (each column summed over the
    ranks) and ``held`` (how many ranks hold 0, 1, ..., K micro-batches; empty if not asked)."""

    sums: list[float]
    held: list[float]

    @property
    def most(self) -> int:
        """The most micro-batches any rank holds (what every rank must run)."""
        return max(i for i, n in enumerate(self.held) if n > 0 or i == 0)


def count_ahead(
    columns: Sequence[float],
    reduce: Reduce | None,
    device: Any,
    *,
    held: int | None = None,
    most: int = 0,
) -> Ahead:
    """``columns`` summed over the ranks, and with ``held`` (this rank's micro-batches, at most
    ``most``) how many ranks hold each number: one collective, one host read.

    >>> a = count_ahead([3.0, 5.0], lambda t: 2 * t, "cpu", held=1, most=2)
    >>> a.sums, a.held, a.most
    ([6.0, 10.0], [0.0, 2.0, 0.0], 1)
    """
    local = torch.zeros(len(columns) + (most + 1 if held is not None else 0), dtype=torch.float64)
    local[: len(columns)] = torch.tensor([float(c) for c in columns], dtype=torch.float64)
    if held is not None:
        local[len(columns) + held] = 1.0
    local = local.to(device)
    values = (local if reduce is None else reduce(local)).tolist()
    return Ahead(values[: len(columns)], values[len(columns) :])


@dataclass(frozen=True)
class Read:
    """A window's numbers over every rank, read in one host sync: ``loss`` (Σ loss_sum),
    ``count`` (Σ recorded counts), ``extras`` (the extra columns' sums), ``squared_norm``."""

    loss: float
    count: float
    extras: list[float]
    squared_norm: float

    @property
    def values(self) -> list[float]:
        """``[loss, count, *extras]``, what a wing's window-end hook receives."""
        return [self.loss, self.count, *self.extras]


class WingWindow:
    """One framework window's numbers: records, the count-ahead check, the read and the close.

    ``loss_scale``: ``c``, what each loss is multiplied by before backward; ``device``: where
    the sums live when nothing was recorded; ``counted``: this rank's counts read before the
    forward (a DeepSpeed window), which the recorded ones must equal.

    >>> w = WingWindow(0.25)
    >>> w.record(torch.tensor(6.0), 2)
    >>> w.record(torch.tensor(2.0), torch.tensor(2.0))
    >>> w.read([torch.tensor([3.0, 4.0])])
    Read(loss=8.0, count=4.0, extras=[], squared_norm=25.0)
    """

    def __init__(
        self,
        loss_scale: float = 1.0,
        *,
        device: Any = "cpu",
        counted: Sequence[float] | None = None,
    ) -> None:
        self.loss_scale = loss_scale
        self.device = device
        self.counted = None if counted is None else [float(c) for c in counted]
        self._rows: list[torch.Tensor] = []

    def __len__(self) -> int:
        """Micro-batches recorded."""
        return len(self._rows)

    def record(
        self, loss_sum: torch.Tensor, count: Any = 0.0, extras: Sequence[torch.Tensor] = ()
    ) -> None:
        """Keep ``[loss_sum, count, *extras]`` as one float64 row on the loss's device."""
        n = torch.as_tensor(count, dtype=torch.float64, device=loss_sum.device).detach()
        row = [loss_sum.detach().double().reshape(1), n.reshape(1)]
        row += [e.detach().double().reshape(1).to(n.device) for e in extras]
        self._rows.append(torch.cat(row))

    def keep_last(self, n: int) -> int:
        """Forget all but the last ``n`` micro-batches (their gradients are gone); how many
        were forgotten."""
        dropped = max(len(self._rows) - n, 0)
        self._rows = self._rows[dropped:]
        return dropped

    def counts(self) -> list[float]:
        """This rank's recorded counts (a host read: for error messages and checks)."""
        return torch.stack(self._rows)[:, 1].tolist() if self._rows else []

    def sums(self) -> torch.Tensor:
        """``[Σ loss_sum, Σ count, bad counts, *Σ extras]`` (float64): one stack, no read."""
        if not self._rows:
            return torch.zeros(3, dtype=torch.float64, device=self.device)
        rows = torch.stack(self._rows)
        counts = rows[:, 1]
        bad = (~torch.isfinite(counts) | (counts < 0)).sum().to(rows).reshape(1)
        total = rows.sum(0)
        return torch.cat([total[:2], bad, total[2:]])

    def check_counted(self, owner: str, source: str, fix: str) -> None:
        """Raise ``ValueError`` when the recorded counts differ from ``counted`` (one read)."""
        if self.counted is None:
            return
        got = self.counts()
        if got != self.counted:
            raise ValueError(
                f"{owner} got counts that differ from {source} ({source} gave {self.counted}, "
                f"the losses held {got}): the loss would be scaled by another N than it holds. "
                + fix
            )

    def read(
        self,
        grads: list[torch.Tensor],
        reduce: Reduce | None = None,
        *,
        shard_copies: float | None = None,
        fix: str = "count exactly the items the summed loss holds",
    ) -> Read:
        """The sums over the ranks and the gradients' squared norm, in one host read; raises
        ``ValueError`` on every rank when a recorded count is negative or not finite."""
        loss, count, bad, *extras, sq = read_totals(
            self.sums(), grads, reduce, shard_copies=shard_copies
        )
        if bad:
            raise ValueError(
                f"{int(bad)} count(s) in this window are negative or not finite (this rank's "
                f"counts: {self.counts()}): {fix}"
            )
        return Read(loss, count, extras, sq)

    def close(
        self,
        read: Read,
        wing: Wing,
        grads: list[torch.Tensor] | None,
        skip: Callable[[Verdict], None] | None = None,
        *,
        count: float | None = None,
        divisor: float = 1.0,
        max_grad_norm: float | None = None,
    ) -> Verdict:
        """The shared verdict on ``read`` (``count``: the window's N where it was counted
        ahead), then ``grads`` scaled and a step counted, or ``skip`` and a skip counted."""
        totals = WindowTotals(
            loss=read.loss,
            count=read.count if count is None else count,
            squared_norm=read.squared_norm,
            divisor=divisor,
            loss_scale=self.loss_scale,
            max_grad_norm=max_grad_norm,
        )
        return close_window(totals, wing, grads, skip)

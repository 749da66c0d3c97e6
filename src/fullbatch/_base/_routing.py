"""The MoE routing pre-pass: a window's routing counts and item count, in one reduction.

The load-balancing loss of a window (:mod:`fullbatch._base._moe`) needs the window's routing
counts before the first backward. A no-grad forward of every micro-batch gives one float64
row (:class:`RoutingRow`: its top-k assignments per expert, routed rows and item count); the
rows are summed over the window and, through the caller's ``summed``, over the ranks in one
collective. The RNG state is put back after the pass, so the training forwards draw the
dropout masks they would draw without it. ``fullbatch.hf`` (Trainer and TRL wings) and the
probe's MoE objective run it; ``window.stats`` is the Accumulator's general form.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from fullbatch._base._moe import router_counts
from fullbatch._base._rng import RngState

__all__ = ["RoutingRow", "window_row"]

M = TypeVar("M")

#: A micro-batch's no-grad forward: ``(router logits, attention mask, the model's outputs)``.
Forward = Callable[[M], tuple[Any, torch.Tensor | None, Any]]


@dataclass(frozen=True)
class RoutingRow:
    """One micro-batch's (summed: a window's) routing counts and item count, packed by name
    into one float64 row ``[experts…, rows, items]`` (``failed`` last where ranks agree on a
    failure) for one reduction.

    >>> row = RoutingRow(torch.tensor([2.0, 0.0]), torch.tensor(2.0), torch.tensor(5.0))
    >>> back = RoutingRow.unpack(row.pack(), flagged=False)
    >>> back.experts.tolist(), back.rows.item(), back.items.item(), back.failed
    ([2.0, 0.0], 2.0, 5.0, None)
    """

    experts: torch.Tensor  # [E] top-k assignments per expert
    rows: torch.Tensor  # routed rows (0-dim)
    items: torch.Tensor  # the loss's item count N (0-dim)
    failed: torch.Tensor | None = None  # ranks whose pre-pass raised (0-dim), where agreed on

    def pack(self) -> torch.Tensor:
        tail = [self.rows, self.items] + ([] if self.failed is None else [self.failed])
        where = self.experts.device
        return torch.cat(
            [self.experts.to(torch.float64), *(t.to(where, torch.float64).reshape(1) for t in tail)]
        )

    @classmethod
    def unpack(cls, row: torch.Tensor, *, flagged: bool) -> RoutingRow:
        end = row.shape[0] - (3 if flagged else 2)
        return cls(row[:end], row[end], row[end + 1], row[end + 2] if flagged else None)

    @property
    def counts(self) -> dict[str, torch.Tensor]:
        """The counts :func:`fullbatch._base._moe.load_balancing` takes."""
        return {"experts": self.experts, "rows": self.rows}


def window_row(
    micro_batches: Iterable[M],
    forward: Forward[M],
    items: Callable[[M, Any], float],
    *,
    top_k: int,
    summed: Callable[[torch.Tensor], torch.Tensor] | None,
    experts: int | None = None,
) -> RoutingRow:
    """The pre-pass: ``forward`` (no grad) on every micro-batch, its router counts and
    ``items(micro, outputs)``, one row each, summed over the window and by ``summed`` (the
    ranks) in one reduction; the RNG state put back after.

    ``experts`` given: the row carries ``failed``, and a rank whose pre-pass raises a
    ``ValueError``, ``TypeError`` or ``RuntimeError`` still joins the reduction (a zero row of
    that many experts, flagged), then raises its error; the others read ``failed`` and raise.
    Without it an error propagates at once.
    """
    flag = None if experts is None else torch.zeros((), dtype=torch.float64)
    rows: list[torch.Tensor] = []
    error: Exception | None = None
    rng = RngState()
    try:
        with torch.no_grad():
            for micro in micro_batches:
                logits, mask, outputs = forward(micro)
                c = router_counts(logits, top_k=top_k, attention_mask=mask)
                n = torch.tensor(float(items(micro, outputs)), dtype=torch.float64)
                rows.append(RoutingRow(c["experts"], c["rows"], n, flag).pack())
    except (ValueError, TypeError, RuntimeError) as raised:
        if experts is None:
            raise
        error = raised
        zero = torch.zeros((), dtype=torch.float64)
        failed = RoutingRow(torch.zeros(experts, dtype=torch.float64), zero, zero, zero + 1)
        rows = [failed.pack()]
    finally:
        rng.restore()
    total = torch.stack([r.to(rows[0].device) for r in rows]).sum(0)
    if summed is not None:
        total = summed(total)
    if error is not None:
        raise error
    return RoutingRow.unpack(total, flagged=experts is not None)

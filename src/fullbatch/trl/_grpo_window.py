"""The numbers of one ``GRPOTrainer`` optimizer window, read before its first backward.

TRL normalizes each micro-batch on its own: a per-micro-batch mean divided by the number of
micro-batches (``grpo``, ``sapo``, ``dr_grpo``, the entropy bonus), or the generation batch's
token count rescaled to a window (``dapo``, ``cispo``). Each is a fixed multiple of the window's
objective for that micro-batch, so one multiplier per loss term and micro-batch turns it into
the window's objective: :func:`grad_scales` computes them, :class:`ScaleGrad` applies them to
the gradient alone, :class:`GRPOWindow` holds the window's counts (per micro-batch, summed over
ranks) and merges the logged metrics into one value per window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "EXACT_LOSSES",
    "SEQUENCE_LOSSES",
    "TOKEN_LOSSES",
    "GRPOWindow",
    "ScaleGrad",
    "grad_scales",
]

# loss types whose objective divides by the window's sequences (dr_grpo: times a constant)
SEQUENCE_LOSSES = ("grpo", "sapo", "dr_grpo")
# loss types whose objective divides by the window's completion tokens
TOKEN_LOSSES = ("dapo", "cispo")
EXACT_LOSSES = SEQUENCE_LOSSES + TOKEN_LOSSES

# metrics TRL appends once per micro-batch, and how one window's values combine
_TOKEN_MEANS = ("entropy", "kl")
_CLIP_MEANS = (
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "cispo_clip_ratio",
)
_MINS = ("clip_ratio/low_min",)
_MAXES = ("clip_ratio/high_max",)


class ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def grad_scales(
    loss_type: str,
    *,
    rows: float,
    tokens: float,
    micro_batches: int,
    world: int,
    window_sequences: float,
    window_tokens: float,
    generation_tokens: float,
    steps_per_generation: int,
) -> tuple[float, float]:
    """Multipliers of one micro-batch's policy and entropy terms, from TRL's to the window's.

    TRL 1.16 divides a micro-batch's policy sum by ``rows · micro_batches`` (``grpo``,
    ``sapo``; ``dr_grpo`` also by ``max_completion_length``) or by
    ``generation_tokens / world · micro_batches / steps_per_generation`` (``dapo``,
    ``cispo``), and its entropy sum by ``tokens · micro_batches``. The window's objective
    divides by ``window_sequences / world`` or ``window_tokens / world`` (data-parallel
    wrappers average gradients over ``world`` ranks).

    Args:
        loss_type: one of :data:`SEQUENCE_LOSSES` or :data:`TOKEN_LOSSES`.
        rows, tokens: this micro-batch's sequences and completion tokens (this rank).
        micro_batches: micro-batches per rank in this window.
        world: data-parallel ranks.
        window_sequences, window_tokens: the window's sequences and completion tokens, all
            micro-batches and ranks.
        generation_tokens: TRL's ``num_items_in_batch`` (the generation batch's tokens).
        steps_per_generation: TRL's ``steps_per_generation``.

    >>> grad_scales("dapo", rows=2, tokens=5, micro_batches=2, world=1, window_sequences=4,
    ...     window_tokens=8, generation_tokens=20, steps_per_generation=4)
    (1.25, 1.25)
    >>> grad_scales("grpo", rows=2, tokens=5, micro_batches=2, world=1, window_sequences=4,
    ...     window_tokens=8, generation_tokens=20, steps_per_generation=4)
    (1.0, 1.25)
    """
    k, n_tokens = micro_batches, max(window_tokens, 1.0)
    if loss_type in SEQUENCE_LOSSES:
        policy = rows * k * world / window_sequences
    elif loss_type in TOKEN_LOSSES:
        policy = max(generation_tokens, 1.0) * k / (steps_per_generation * n_tokens)
    else:
        raise ValueError(f"no window scale for loss_type={loss_type!r}")
    entropy = max(tokens, 1.0) * k * world / n_tokens
    return policy, entropy


@dataclass
class GRPOWindow:
    """One optimizer window: per micro-batch counts (this rank and all ranks) and metrics.

    ``rows[j]``/``tokens[j]``: micro-batch ``j`` on this rank; ``global_rows[j]`` /
    ``global_tokens[j]``: micro-batch ``j`` summed over ranks; ``generation_tokens[j]``:
    TRL's ``num_items_in_batch`` of the generation batch it came from.

    >>> w = GRPOWindow([2, 2], [5, 3], [2, 2], [5, 3], [20, 20], world=1)
    >>> w.sequences, w.tokens_total
    (4.0, 8.0)
    >>> w.add_metrics(0, {"entropy": [1.0], "clip_ratio/high_max": [0.5]}, by_rows=False)
    >>> w.add_metrics(1, {"entropy": [3.0], "clip_ratio/high_max": [0.25]}, by_rows=False)
    >>> w.merged_metrics()
    {'entropy': 1.75, 'clip_ratio/high_max': 0.5}
    """

    rows: list[float]
    tokens: list[float]
    global_rows: list[float]
    global_tokens: list[float]
    generation_tokens: list[float]
    world: int
    policy_share: float = 0.0  # this rank's sum of exact policy shares (for "policy_loss")
    _sums: dict[str, list[float]] = field(default_factory=dict)

    @property
    def sequences(self) -> float:
        return float(sum(self.global_rows))

    @property
    def tokens_total(self) -> float:
        return float(sum(self.global_tokens))

    def __len__(self) -> int:
        return len(self.rows)

    def scales(self, j: int, loss_type: str, steps_per_generation: int) -> tuple[float, float]:
        """:func:`grad_scales` for micro-batch ``j``."""
        return grad_scales(
            loss_type,
            rows=self.rows[j],
            tokens=self.tokens[j],
            micro_batches=len(self.rows),
            world=self.world,
            window_sequences=self.sequences,
            window_tokens=self.tokens_total,
            generation_tokens=self.generation_tokens[j],
            steps_per_generation=steps_per_generation,
        )

    def add_metrics(self, j: int, appended: dict[str, list[float]], *, by_rows: bool) -> None:
        """Fold micro-batch ``j``'s metric values (means over its tokens, or extremes)."""
        for key, values in appended.items():
            for value in values:
                if key in _TOKEN_MEANS or key in _CLIP_MEANS:
                    weight = self.global_rows[j] if by_rows and key in _CLIP_MEANS else None
                    weight = self.global_tokens[j] if weight is None else weight
                    acc = self._sums.setdefault(key, [0.0, 0.0])
                    acc[0] += value * weight
                    acc[1] += weight
                elif not math.isnan(value):
                    best = self._sums.setdefault(key, [value])
                    pick = min if key in _MINS else max
                    best[0] = pick(best[0], value)

    def take_metrics(
        self, j: int, metrics: Any, before: dict[str, int], *, by_rows: bool
    ) -> dict[str, bool]:
        """Take micro-batch ``j``'s values out of TRL's ``metrics`` (appended since ``before``):
        the merged ones are folded in; ``policy_loss`` and ``aux_loss``, dropped, are logged as
        the window's by the trainer. Returns whether TRL appended each of those two."""
        keys = set(self.merged_keys())
        appended: dict[str, list[float]] = {}
        for key in list(metrics):
            if key in keys and len(metrics[key]) > before.get(key, 0):
                appended[key] = metrics[key][before.get(key, 0) :]
                del metrics[key][before.get(key, 0) :]
        self.add_metrics(j, appended, by_rows=by_rows)
        had = {}
        for key in ("policy_loss", "aux_loss"):
            had[key] = len(metrics.get(key, [])) > before.get(key, 0)
            if had[key]:
                del metrics[key][before.get(key, 0) :]
        return had

    def merged_metrics(self) -> dict[str, float]:
        """One value per metric for the whole window."""
        out = {}
        for key, acc in self._sums.items():
            out[key] = acc[0] / max(acc[1], 1.0) if len(acc) == 2 else acc[0]
        return out

    @staticmethod
    def merged_keys() -> tuple[str, ...]:
        return _TOKEN_MEANS + _CLIP_MEANS + _MINS + _MAXES

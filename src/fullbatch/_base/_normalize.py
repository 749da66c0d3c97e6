"""The numbers of normalization: counts, the loss constant ``c``, the gradient multiplier.

The normalization's scale factors are computed here (STYLE rule 2):

- ``c`` multiplies every loss before backward. It is a power of two, so multiplying by it is
  exact in every floating-point format, and it is ``<= 1 / N`` (within a factor 2) so that
  fp16 gradients stay in range. It is fixed before a window's first backward, from the
  previous window's ``N``, or for the first window from an estimate of its size.
- at the step the gradient is multiplied by ``W / (c · N)`` (count form) or ``W`` (share form),
  computed in float64, where ``W`` is the divisor the data-parallel wrapper applies.

Whether a window steps at all, and with which of these numbers, is decided once for every
wing in :mod:`fullbatch._base._verdict`, which calls this module; the clip factor
``min(1, max_grad_norm / (norm + 1e-6))`` is computed there, beside that decision. Two scales
live with the wing whose objective they express: the GRPO trainer's per-term, per-micro-batch
gradient scales (``fullbatch.trl._grpo_window.grad_scales``, applied in its backward: the
share form) and a framework's own divisor ``W`` (Lightning's and the Trainer's ``loss / K``),
which the wing hands to the verdict.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from numbers import Real
from typing import Any

import torch

__all__ = [
    "accumulation_dtype",
    "check_count",
    "estimate_items",
    "grad_factor",
    "power_of_two_scale",
    "scale_grads",
    "squared_norm",
]


def accumulation_dtype(device: torch.device) -> torch.dtype:
    """float64 for loss and count sums, except where the device has none (MPS)."""
    return torch.float32 if device.type == "mps" else torch.float64


def check_count(count: Any) -> float | torch.Tensor:
    """Validate one ``count`` argument of ``window.backward``.

    Python numbers and CPU tensors are checked now; a tensor on an accelerator is returned as
    a 0-dim tensor and checked at ``step()`` (checking now would stall the device queue).

    Raises:
        ValueError: the count is negative, non-finite, boolean, complex, or not a number.
    """
    fix = (
        "A count is the number (or total weight) of items the loss sums over: a finite "
        "number >= 0, e.g. the `n` returned by fb.causal_lm_loss."
    )
    if isinstance(count, torch.Tensor):
        if count.numel() != 1:
            raise ValueError(f"count must be a 0-dim tensor, got shape {tuple(count.shape)}. {fix}")
        if count.dtype == torch.bool or count.is_complex():
            raise ValueError(f"count has dtype {count.dtype}, not a real number. {fix}")
        if not count.is_cpu:  # kept as a 0-dim tensor, checked at the step (no host sync)
            count = count.detach()
            return count if count.dim() == 0 else count.reshape(())
        value = float(count)  # a CPU tensor: read now (no detach nor reshape: ~5 us each call)
    elif isinstance(count, Real) and not isinstance(count, bool):
        value = float(count)
    else:
        raise ValueError(f"count must be a number or 0-dim tensor, got {count!r}. {fix}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"count must be finite and >= 0, got {value!r}. {fix}")
    return value


def power_of_two_scale(items: float) -> float:
    """The largest power of two ``c`` with ``c · items <= 1`` (1.0 for ``items <= 1``).

    Rounding down, not to nearest: ``c·N`` of the next window then exceeds 1 only when that
    window holds more items than this one, so fp16 gradients are rarely larger than those of
    a loop that backpropagates ``loss_sum / N``.

    >>> power_of_two_scale(1000), power_of_two_scale(1024), power_of_two_scale(0.5)
    (0.0009765625, 0.0009765625, 1.0)
    """
    if not math.isfinite(items) or items <= 1:
        return 1.0
    return math.ldexp(1.0, -math.ceil(math.log2(items)))


def grad_factor(divisor: float, count: float | None, loss_scale: float = 1.0) -> float:
    """The one multiplier that turns accumulated gradients into the full-batch gradient.

    ``divisor / (loss_scale · count)``: ``divisor`` undoes what the wrapper (and a framework's
    own accumulation) divided by, ``loss_scale`` (``c``) what every loss was multiplied by, and
    ``count`` is the window's ``N``. ``count=None`` is the share form (losses already divided
    by their total): ``divisor`` alone. ``count=0`` gives 0 (the window is skipped). Called
    by :func:`fullbatch._base._verdict.decide`, through which every wing ends its window.

    >>> grad_factor(2.0, 8.0, 0.125), grad_factor(2.0, None), grad_factor(4.0, 0.0)
    (2.0, 2.0, 0.0)
    """
    if count is None:
        return divisor
    return divisor / (loss_scale * count) if count else 0.0


def estimate_items(micro: Any) -> float:
    """A cheap upper estimate of the items in a micro-batch, used only to pick the first ``c``.

    ``labels`` (any mapping key) count their elements; otherwise the row count of the first
    tensor; otherwise 1. Exactness never depends on it: only fp16 range does.
    """
    tensors: list[torch.Tensor] = []

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            tensors.append(x)
        elif isinstance(x, Mapping):
            if isinstance(x.get("labels"), torch.Tensor):
                tensors.insert(0, x["labels"])
            for v in x.values():
                walk(v)
        elif isinstance(x, Sequence) and not isinstance(x, (str, bytes)):
            for v in x:
                walk(v)

    walk(micro)
    for t in tensors:
        if t.dim() >= 1:
            if not t.is_floating_point():
                return float(t.numel())
            return float(t.shape[0])
    return 1.0


def _grouped(
    grads: list[torch.Tensor],
) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    return groups


def _local(g: torch.Tensor) -> torch.Tensor:
    # A DTensor (FSDP2) gradient: each rank holds a shard; norms and scaling work per shard.
    to_local = getattr(g, "to_local", None)
    return to_local() if to_local is not None else g


def squared_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squares of this rank's (local shards of the) gradients, as a float64 tensor."""
    dtype = accumulation_dtype(device)
    total = torch.zeros((), dtype=dtype, device=device)
    for group in _grouped([_local(g) for g in grads]).values():
        norms = torch._foreach_norm(group, 2.0)
        total += torch.stack([n.to(device=device, dtype=dtype) for n in norms]).square().sum()
    return total


def scale_grads(grads: list[torch.Tensor], factor: float) -> None:
    """Multiply every gradient in place by ``factor`` (one fused pass per device and dtype)."""
    if factor == 1.0:
        return
    for group in _grouped([_local(g) for g in grads]).values():
        torch._foreach_mul_(group, factor)

"""How far a gradient may move by rounding alone: the band's factor and cap, the dtype floor.

``fb.verify``, ``fullbatch.hf.check_trainer`` and ``fb.probe`` judge an error against a
*rounding band* measured on the user's model (the same math computed another way: rows
reordered, the loss normalized after backward instead of before), never a fixed dtype
tolerance: :func:`tolerance` is ``BAND_FACTOR`` times the band, at least ``FLOOR_ULPS`` units
in the last place of the dtype. A band above ``BAND_CAP`` is no rounding (the model is random,
not finite, or its rows interact): the floor alone then applies.
"""

from __future__ import annotations

import torch

__all__ = ["BAND_CAP", "BAND_FACTOR", "FLOOR_ULPS", "eps", "tolerance", "unit_roundoff"]

#: An error passes within this many times the model's own rounding band. Measured on tiny
#: Llama and GPT-2 (bf16/fp16 autocast, bf16/fp16 parameters, 8 padded rows, 1/2/5 rows per
#: micro-batch, 3 seeds; 72 runs): fullbatch's error was 0.68-1.36 times the band.
BAND_FACTOR = 4.0
#: A band above this is no rounding (bfloat16's epsilon is 7.8e-3): the tolerance is not widened.
BAND_CAP = 0.1
#: The tolerance is never below this many units in the last place of the dtype: a full batch
#: whose permuted rows round identically (band 0) still sums micro-batches in another order.
FLOOR_ULPS = 16


def eps(dtype: torch.dtype) -> float:
    """Machine epsilon of a floating dtype (0.0 for any other).

    >>> eps(torch.bfloat16), eps(torch.int64)
    (0.0078125, 0.0)
    """
    return float(torch.finfo(dtype).eps) if dtype.is_floating_point else 0.0


def unit_roundoff(dtype: torch.dtype) -> float:
    """``eps / 2``: the largest relative error of rounding one number to ``dtype``.

    >>> unit_roundoff(torch.bfloat16), unit_roundoff(torch.float32)
    (0.00390625, 5.960464477539063e-08)
    """
    return eps(dtype) / 2


def tolerance(band: float, dtype: torch.dtype) -> float:
    """The relative error a gradient held in ``dtype`` may show when its rounding band is
    ``band``: ``max(BAND_FACTOR * band, FLOOR_ULPS * eps)``, the floor alone for a band that is
    no rounding (above ``BAND_CAP``, or NaN).

    >>> tolerance(1e-3, torch.float32)
    0.004
    >>> tolerance(float("nan"), torch.float64) == FLOOR_ULPS * eps(torch.float64)
    True
    """
    floor = FLOOR_ULPS * eps(dtype)
    if not band <= BAND_CAP:
        return floor
    return max(BAND_FACTOR * band, floor)

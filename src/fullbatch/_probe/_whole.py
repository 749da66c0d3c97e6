"""A declared coupled objective (``fb.probe(objective=fn, coupled=True)``, ``--coupled``): the
window compared with ``fn`` over its whole rows as one batch.

A loss with in-batch negatives is no sum over micro-batches, so the per-micro-batch reference
``Σ_k ∇ fn(micro_k) / N`` is not the full batch's. Declared coupled, the window's reference is
``∇ fn(whole) / count(whole)``, ``whole`` every micro-batch the loop held, rows concatenated in
the order they ran: the full-batch objective ``window.run_coupled`` makes exact (DESIGN.md,
coupled losses; the encoder sees each row alone, the loss sees all of them). Its band is
measured like every window's (:mod:`fullbatch._probe._reference`): the whole differentiated
again with its loss scaled and its rows reversed. The per-micro-batch reference is kept beside
it: a step that equals it (each micro-batch's own InfoNCE) is named by the judge
(:mod:`fullbatch._probe._judge_coupled`) as a coupled loss taken per micro-batch.
What it costs beyond a window's check: one forward and backward over the whole window (and
the band's second one), and a second gradient-sized buffer while the reference is built.

Refused by name, never judged (pattern ``"coupled loss"``): several processes or an engine
other than ``.grad`` (the whole window's forward would run on one rank, outside the engine's
collectives), micro-batches that cannot be concatenated, and active dropout (one forward over
the whole draws other masks than the loop's forwards did).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from fullbatch._probe._call_loss import ObjectiveFn
from fullbatch._probe._capture import Call
from fullbatch._probe._coupled import joined
from fullbatch._probe._fit import Fit
from fullbatch._probe._reference import LocalReference, recompute
from fullbatch._probe._replay import dropout_active
from fullbatch._probe._sample import Sampler
from fullbatch._proof._tolerance import tolerance

__all__ = ["Whole", "whole_fit", "whole_window"]


@dataclass
class Whole:
    """A declared coupled objective's share of a window: the reference over the whole window
    (``rec``: ``∇ fn(whole)``, its band and its count), or why it is refused (``refusal``)."""

    rec: LocalReference | None = None
    refusal: str | None = None

    @property
    def count(self) -> float:
        return self.rec.counts[0] if self.rec is not None and self.rec.counts else 0.0


def _refused(name: str, why: str) -> Whole:
    return Whole(
        refusal=(
            f"coupled loss: the declared coupled objective {name} cannot be compared over the "
            f"whole window here: {why}. Make the window's loss the full batch's with "
            "fb.Accumulator's window.run_coupled(encode, loss) (docs/coupled.md) and check it "
            "with fb.verify"
        )
    )


def whole_window(
    calls: list[Call], params: list[nn.Parameter], sampler: Sampler, objective: ObjectiveFn,
    *, name: str, alone: bool,
) -> Whole:  # fmt: skip
    """``∇ fn`` over the window's micro-batches as one (see the module docstring), or why not;
    ``alone``: one process, gradients in ``.grad``."""
    if not alone:
        return _refused(name, "it runs on one process with gradients in .grad only")
    if dropout_active(calls[0].module):
        return _refused(name, "dropout is active, and one forward over the whole window draws "
                        "other masks than the micro-batches did")  # fmt: skip
    micro = joined([c.user_micro() for c in calls]) if calls else None
    if micro is None:
        return _refused(name, "its micro-batches cannot be concatenated row by row")
    first = calls[0]
    whole = Call(first.module, first.wrapper, (), {}, first.rng, first.autocast, micro=micro)
    return Whole(rec=recompute([whole], params, sampler, objective))


def whole_fit(
    whole: Whole, sums: torch.Tensor, k: int, raw_norm: float, eps: torch.dtype
) -> tuple[float, float, Fit]:
    """The window's band, tolerance and fit against the whole window's reference: ``sums``
    ``[‖a − r‖², ‖r‖², ‖a‖²]`` over every optimizer's parameters (one process), ``k`` the
    micro-batches, ``raw_norm`` ``‖∇ fn(whole)‖``. The fit is the exact factor
    ``<a, r> / <r, r>`` alone, its precision the band: a coupled objective gives no weight per
    micro-batch."""
    assert whole.rec is not None
    band = math.sqrt(k) * whole.rec.band / raw_norm if raw_norm > 0 else math.nan
    diff, ref, applied = (float(v) for v in sums[:3])
    factor = (applied + ref - diff) / (2 * ref) if ref > 0 else math.nan
    return band, tolerance(band, eps), Fit((), factor=factor, factor_stderr=band)

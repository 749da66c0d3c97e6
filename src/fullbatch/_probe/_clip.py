"""See the gradient clips of a window while it is probed.

Engines clip between the last backward and ``step()`` (the Hugging Face Trainer through
Accelerate, Lightning's ``gradient_clip_val``, a loop's ``clip_grad_norm_``), so the gradient at
``step()`` is the window's gradient times the clip's coefficient. While probing, the function
that applies the clip, ``torch.nn.utils.clip_grad._clip_grads_with_norm_`` (which
``clip_grad_norm_`` looks up in its module when it runs, and which ``torch.nn.utils`` exports as
``clip_grads_with_norm_``), is wrapped to record the coefficient it multiplies by: a
``clip_grad_norm_`` imported before the probe started (``from torch.nn.utils import
clip_grad_norm_``) is seen too. The reference is multiplied by that coefficient, so the
comparison is the one before the clip. The originals are put back when probing ends.
``clip_grad_value_`` (entry-wise, no full-batch equivalent) is recorded where it is looked up
(``torch.nn.utils.clip_grad_value_``) so the window says why it cannot be compared.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.utils import clip_grad as clip_module

from fullbatch._probe._engines import Engine

__all__ = ["Clip", "ClipObserver"]


@dataclass(frozen=True)
class Clip:
    """One ``clip_grad_norm_`` call: the ids of its parameters that hold a gradient,
    ``max_norm``, the norm it measured and the coefficient it multiplied the gradients by (1.0
    when it did not clip); ``coef`` NaN for a ``clip_grad_value_`` call; ``source``: what
    clipped, for the report (``"clip_grad_norm_(max_norm=1)"``)."""

    params: frozenset[int]
    max_norm: float
    total_norm: float
    coef: float
    source: str = ""


@dataclass
class ClipObserver:
    clips: list[Clip] = field(default_factory=list)
    _saved: dict[str, Any] = field(default_factory=dict)

    def start(self) -> None:
        apply = clip_module._clip_grads_with_norm_
        value = torch.nn.utils.clip_grad_value_

        @functools.wraps(apply)
        def clip_grads_with_norm_(
            parameters: Any, max_norm: float, total_norm: torch.Tensor, *args: Any, **kwargs: Any
        ) -> Any:
            params = _listed(parameters)
            norm = torch.as_tensor(total_norm).detach()
            coef = (float(max_norm) / (norm + 1e-6)).clamp(max=1.0)  # as torch computes it
            ids = frozenset(id(p) for p in params if p.grad is not None)
            source = f"clip_grad_norm_(max_norm={float(max_norm):g})"
            self.clips.append(Clip(ids, float(max_norm), float(norm), float(coef), source))
            return apply(params, max_norm, total_norm, *args, **kwargs)

        @functools.wraps(value)
        def clip_grad_value_(parameters: Any, clip_value: float, *args: Any, **kwargs: Any) -> Any:
            params = _listed(parameters)
            ids = frozenset(id(p) for p in params)
            self.clips.append(Clip(ids, float(clip_value), 0.0, float("nan")))
            return value(params, clip_value, *args, **kwargs)

        self._saved = {
            "_clip_grads_with_norm_": (apply, clip_grads_with_norm_, (clip_module,)),
            "clip_grads_with_norm_": (apply, clip_grads_with_norm_, (torch.nn.utils,)),
            "clip_grad_value_": (value, clip_grad_value_, (torch.nn.utils, clip_module)),
        }
        for name, (_, wrapper, owners) in self._saved.items():
            for owner in owners:
                setattr(owner, name, wrapper)

    def stop(self) -> None:
        """Put the originals back (where the attribute is still this observer's wrapper)."""
        for name, (original, wrapper, owners) in self._saved.items():
            for owner in owners:
                if getattr(owner, name, None) is wrapper:
                    setattr(owner, name, original)
        self._saved = {}

    def take(self, params: set[int]) -> list[Clip]:
        """The clips since the last take that touched any of ``params``."""
        return [c for c in self.take_all() if c.params & params]

    def take_all(self) -> list[Clip]:
        """Every clip since the last take."""
        clips, self.clips = self.clips, []
        return clips

    def for_step(self, params: Sequence[torch.Tensor], engine: Engine) -> list[Clip]:
        """The clips since the last take, and a clip the stepping engine applied by its own
        multiply (``fb.Accumulator(max_grad_norm=...)``), on ``params``, as it published it."""
        clips = self.take_all()
        if engine.clip is not None:
            max_norm, total, coef = engine.clip
            source = f"{engine.name}'s clip at max_grad_norm={max_norm:g}"
            clips.append(Clip(frozenset(id(p) for p in params), max_norm, total, coef, source))
        return clips


def _listed(parameters: Any) -> list[torch.Tensor]:
    if isinstance(parameters, torch.Tensor):
        return [parameters]
    assert isinstance(parameters, Iterable)
    return list(parameters)

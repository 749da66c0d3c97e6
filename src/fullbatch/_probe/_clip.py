"""See ``torch.nn.utils.clip_grad_norm_`` calls while windows are probed.

Engines clip between the last backward and ``step()`` (the Hugging Face Trainer through
Accelerate, Lightning's ``gradient_clip_val``), so the gradient at ``step()`` is the window's
gradient times the clip's coefficient. While probing, ``torch.nn.utils.clip_grad_norm_`` is
replaced by a wrapper that calls the original and records the coefficient it applied; the
reference is multiplied by it, so the comparison is the one before the clip. The original is
put back when probing ends. ``clip_grad_value_`` (entry-wise, no full-batch equivalent) is
recorded so the window says why it cannot be compared.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.utils import clip_grad as clip_module

__all__ = ["Clip", "ClipObserver"]


@dataclass(frozen=True)
class Clip:
    """One ``clip_grad_norm_`` call: its parameters' ids, ``max_norm``, the norm it measured and
    the coefficient it multiplied the gradients by (1.0 when it did not clip); ``coef`` NaN for
    a ``clip_grad_value_`` call."""

    params: frozenset[int]
    max_norm: float
    total_norm: float
    coef: float


@dataclass
class ClipObserver:
    clips: list[Clip] = field(default_factory=list)
    _saved: dict[str, Any] = field(default_factory=dict)

    def start(self) -> None:
        norm = torch.nn.utils.clip_grad_norm_
        value = torch.nn.utils.clip_grad_value_

        @functools.wraps(norm)
        def clip_grad_norm_(parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> Any:
            params = _listed(parameters)
            total = norm(params, max_norm, *args, **kwargs)
            coef = (max_norm / (total.detach() + 1e-6)).clamp(max=1.0)
            ids = frozenset(id(p) for p in params)
            self.clips.append(Clip(ids, float(max_norm), float(total), float(coef)))
            return total

        @functools.wraps(value)
        def clip_grad_value_(parameters: Any, clip_value: float, *args: Any, **kwargs: Any) -> Any:
            params = _listed(parameters)
            ids = frozenset(id(p) for p in params)
            self.clips.append(Clip(ids, float(clip_value), 0.0, float("nan")))
            return value(params, clip_value, *args, **kwargs)

        self._saved = {
            "clip_grad_norm_": (norm, clip_grad_norm_),
            "clip_grad_value_": (value, clip_grad_value_),
        }
        for name, (_, wrapper) in self._saved.items():
            setattr(torch.nn.utils, name, wrapper)
            setattr(clip_module, name, wrapper)

    def stop(self) -> None:
        """Put the originals back (where the attribute is still this observer's wrapper)."""
        for name, (original, wrapper) in self._saved.items():
            for owner in (torch.nn.utils, clip_module):
                if getattr(owner, name) is wrapper:
                    setattr(owner, name, original)
        self._saved = {}

    def take(self, params: set[int]) -> list[Clip]:
        """The clips since the last take that touched any of ``params``."""
        clips, self.clips = self.clips, []
        return [c for c in clips if c.params & params]


def _listed(parameters: Any) -> list[torch.Tensor]:
    if isinstance(parameters, torch.Tensor):
        return [parameters]
    assert isinstance(parameters, Iterable)
    return list(parameters)

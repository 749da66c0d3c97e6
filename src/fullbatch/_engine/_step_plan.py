"""``StepPlan``: the step's options, parsed once, and the parameters the step normalizes.

``scheduler`` (stepped once per optimizer step), ``scaler`` (an enabled GradScaler, or None),
``max_grad_norm`` (clip), ``accumulate_dtype`` (float32 buffers for low-precision gradients)
and ``batchnorm`` (window statistics) are checked here before anything changes. What is built
from them needs the model, its parameters and the sync: the float32 buffers
(:func:`fullbatch._engine._precision.make_grad_buffers`, whose rules against the wrapper and
the scaler live there) and the BatchNorm window statistics
(:class:`fullbatch._engine._batchnorm.WindowBatchNorm`).

>>> StepPlan(max_grad_norm=1).max_grad_norm
1.0
>>> StepPlan(batchnorm="micro")
Traceback (most recent call last):
ValueError: batchnorm must be None or 'window', got 'micro'.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

__all__ = ["BatchNormMode", "StepPlan", "trained_params"]

BatchNormMode = Literal["window"]


@dataclass(kw_only=True, slots=True, frozen=True)
class StepPlan:
    """How a window's step is taken (see the Accumulator's docstring for each option).

    ``scaler`` holds the GradScaler only when it is enabled (None otherwise).

    Raises:
        ValueError: ``max_grad_norm`` not a finite number > 0, ``batchnorm`` not None or
            ``"window"``, ``accumulate_dtype`` not a floating torch dtype.
    """

    scheduler: Any = None
    scaler: Any = None
    max_grad_norm: float | None = None
    accumulate_dtype: torch.dtype | None = None
    batchnorm: BatchNormMode | None = None

    def __post_init__(self) -> None:
        clip = self.max_grad_norm
        if clip is not None:
            if not (0 < float(clip) < math.inf):
                raise ValueError(f"max_grad_norm must be a finite number > 0, got {clip!r}.")
            object.__setattr__(self, "max_grad_norm", float(clip))
        if self.batchnorm not in (None, "window"):
            raise ValueError(f"batchnorm must be None or 'window', got {self.batchnorm!r}.")
        dtype = self.accumulate_dtype
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(
                f"accumulate_dtype must be a floating torch dtype, got {dtype!r}; "
                "use accumulate_dtype=torch.float32 to accumulate bf16/fp16 gradients in float32."
            )
        if self.scaler is not None and not self.scaler.is_enabled():
            object.__setattr__(self, "scaler", None)  # a disabled GradScaler does nothing

    @property
    def window_batchnorm(self) -> bool:
        """``batchnorm="window"``: BatchNorm layers get the window's running statistics."""
        return self.batchnorm == "window"


def trained_params(
    model: nn.Module, optimizer: torch.optim.Optimizer, *, distributed: bool
) -> list[nn.Parameter]:
    """The parameters whose gradients fullbatch normalizes: the model's and the optimizer's.

    A parameter the optimizer steps but the model does not own (a learnable temperature, a
    loss weight) is normalized like the rest; under DDP/FSDP2 it is refused, since the
    wrapper would not reduce its gradient over ranks.
    """
    params = {id(p): p for p in model.parameters() if p.requires_grad}
    owned = set(params)
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if owned and not owned & stepped:
        raise ValueError(
            f"the optimizer holds {len(stepped)} parameter(s) but none of the model's "
            f"{len(owned)} trainable parameters, so training would never change the model. "
            "Build the optimizer from this model's parameters after any copy or wrapping that "
            "replaces them (copy.deepcopy, fully_shard), e.g. "
            "torch.optim.AdamW(model.parameters(), ...)."
        )
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and id(p) not in owned:
                if distributed:
                    raise ValueError(
                        f"the optimizer holds a parameter of shape {tuple(p.shape)} that the "
                        "wrapped model does not own; DDP/FSDP2 would not reduce its gradient "
                        "over ranks. Register it on the model (e.g. as an nn.Parameter "
                        "attribute of a submodule) before wrapping."
                    )
                params[id(p)] = p
    if not params:
        raise ValueError("the model has no parameter with requires_grad=True: nothing to train.")
    return list(params.values())

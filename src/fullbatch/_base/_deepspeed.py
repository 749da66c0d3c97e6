"""What every floor (the probe, the wings) knows of DeepSpeed without importing it.

:func:`is_deepspeed_engine` recognises an engine, read from ``sys.modules``: nothing is
imported, and an engine exists only where its user imported DeepSpeed. :func:`refusal` names a
configuration whose step no scale can make exact (``ExactEngine``, the Trainer wing and the
probe refuse the same ones).
"""

from __future__ import annotations

import importlib.metadata
import sys
from typing import Any

__all__ = ["OFFLOAD_FIXED", "installed_version", "is_deepspeed_engine", "refusal"]


def is_deepspeed_engine(obj: Any) -> bool:
    """Whether ``obj`` is a ``DeepSpeedEngine``.

    >>> is_deepspeed_engine(object())
    False
    """
    engine = sys.modules.get("deepspeed.runtime.engine")
    cls = getattr(engine, "DeepSpeedEngine", None)
    return cls is not None and isinstance(obj, cls)


#: the first deepspeed release whose ZeRO-2 ``offload_optimizer`` accumulates every backward
#: of a step: before it, with ``gradient_accumulation_steps > 1`` only the first micro-batch's
#: gradient was kept (a regression of DeepSpeed #6550, fixed by #7967), and with several
#: backward calls at ``gradient_accumulation_steps=1`` only the last (fixed by #7981); both
#: fixes precede the 0.19.0 release (#7996 bumped the version after it). ZeRO-1 reduces once per
#: step and was exact on 0.17.0 (``benchmarks/deepspeed_offload_matrix.py``).
OFFLOAD_FIXED = (0, 19, 0)


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def installed_version() -> str:
    """deepspeed's version: the imported module's (an engine exists), else the installed one."""
    module = sys.modules.get("deepspeed")
    return str(getattr(module, "__version__", "")) or importlib.metadata.version("deepspeed")


def refusal(
    *,
    stage: int,
    offload: bool,
    micro_batches: int,
    version: str,
    moe: bool = False,
    sequence_parallel: bool = False,
    half: bool = False,
) -> str | None:
    """Why a DeepSpeed configuration's step cannot be made exact, or ``None``.

    >>> refusal(stage=2, offload=True, micro_batches=4, version="0.17.0")[:40]
    'deepspeed 0.17.0 with ZeRO-2 offload_opt'
    >>> refusal(stage=1, offload=True, micro_batches=4, version="0.17.0") is None
    True
    """
    if moe:
        return (
            "the model has DeepSpeed MoE layers, whose expert gradients are averaged over the "
            "expert-data-parallel group, not the data-parallel ranks fullbatch counts over"
        )
    if sequence_parallel:
        return (
            "sequence parallelism divides gradients by another group than the data-parallel "
            "ranks; train with sequence_parallel_size=1"
        )
    if stage == 0 and half:
        return (
            "at ZeRO stage 0, fp16/bf16 gradients live in DeepSpeed's own mixed-precision "
            "optimizer; use ZeRO stage 1-3 (or fp32)"
        )
    if stage == 2 and offload and micro_batches > 1 and _version(version) < OFFLOAD_FIXED:
        return (
            f"deepspeed {version} with ZeRO-2 offload_optimizer keeps only one backward's "
            "gradient of every window (DeepSpeed #6550's regression, fixed by #7967 and #7981 "
            "before 0.19.0): upgrade deepspeed, or use ZeRO-1 or ZeRO-3 offload, or drop "
            "offload_optimizer, or use one micro-batch per step"
        )
    return None

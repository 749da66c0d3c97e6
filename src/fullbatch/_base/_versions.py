"""Where a declared version range does not hold everywhere: a clear error, or a safe default.

- **FSDP2 on CPU** needs torch >= 2.7: FSDP2 calls ``record_event`` on the device's stream,
  and ``torch.cpu.Stream`` gained it (a no-op) in pytorch#145935, first released in 2.7.
  On torch 2.6, ``fully_shard`` on CPU fails with an ``AttributeError`` deep inside FSDP2;
  :func:`check_fsdp2_device` says so first. FSDP2 on CUDA works from torch 2.6.
- **Pipeline parallelism** needs torch >= 2.7: :class:`fullbatch.Pipeline` refuses a
  schedule that scales gradients, and relies on the schedule's ``scale_grads`` flag (added
  with the gradient scaling itself in pytorch#144352, first released in 2.7) to tell.
  torch 2.6's schedules have no such flag; :func:`check_pipeline_schedule` says so.
- **Trainer parallelism sizes**: ``Trainer.get_cp_size`` / ``get_sp_size`` (context and
  sequence parallelism) exist only in recent transformers (not in 4.57); a Trainer without
  them has no such parallelism, so :func:`trainer_parallel_size` counts them as 1.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = [
    "FSDP2_CPU_TORCH",
    "PIPELINE_TORCH",
    "check_fsdp2_device",
    "check_pipeline_schedule",
    "torch_version",
    "trainer_parallel_size",
]

#: the first torch release whose CPU stream has record_event (pytorch#145935)
FSDP2_CPU_TORCH = (2, 7)
#: the first torch release whose pipeline schedules have ``scale_grads`` (pytorch#144352)
PIPELINE_TORCH = (2, 7)


def torch_version(version: str | None = None) -> tuple[int, int]:
    """``(major, minor)`` of torch (or of ``version``).

    >>> torch_version("2.6.0+cpu"), torch_version("2.10.1")
    ((2, 6), (2, 10))
    """
    parts = (version or torch.__version__).split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


def check_fsdp2_device(model: nn.Module, version: str | None = None) -> None:
    """Raise when an FSDP2 model lives on CPU and torch is older than 2.7.

    >>> check_fsdp2_device(torch.nn.Linear(2, 2), "2.6.0")
    Traceback (most recent call last):
    ...
    RuntimeError: FSDP2 (fully_shard) on CPU needs torch >= 2.7, found 2.6.0: ...
    """
    if torch_version(version) >= FSDP2_CPU_TORCH:
        return
    param = next(model.parameters(), None)
    if param is not None and param.device.type == "cpu":
        found = version or torch.__version__
        raise RuntimeError(
            f"FSDP2 (fully_shard) on CPU needs torch >= 2.7, found {found}: torch.cpu.Stream "
            "has no record_event before pytorch#145935, and FSDP2 calls it every step. "
            "Upgrade torch, run FSDP2 on GPUs, or use DDP on CPU."
        )


def check_pipeline_schedule(schedule: Any, version: str | None = None) -> None:
    """Raise when a pipeline schedule has no ``scale_grads`` flag (torch older than 2.7).

    >>> class Schedule26:  # torch 2.6: no scale_grads
    ...     pass
    >>> check_pipeline_schedule(Schedule26(), "2.6.0")
    Traceback (most recent call last):
    ...
    RuntimeError: fullbatch.Pipeline needs torch >= 2.7, found 2.6.0: ...
    """
    if hasattr(schedule, "scale_grads"):
        return
    found = version or torch.__version__
    raise RuntimeError(
        f"fullbatch.Pipeline needs torch >= 2.7, found {found}: {type(schedule).__name__} has "
        "no scale_grads flag (added in pytorch#144352, torch 2.7), which fullbatch reads to "
        "refuse a schedule that divides gradients by n_microbatches. Upgrade torch to >= 2.7."
    )


def trainer_parallel_size(trainer: Any) -> int:
    """Tensor x context x sequence parallel size of a Hugging Face Trainer (absent: 1).

    >>> class OldTrainer:
    ...     def get_tp_size(self): return 1
    >>> trainer_parallel_size(OldTrainer())
    1
    """
    size = 1
    for name in ("get_tp_size", "get_cp_size", "get_sp_size"):
        getter = getattr(trainer, name, None)
        size *= int(getter()) if callable(getter) else 1
    return size

"""The collectives of a pipeline-parallel window: tiny sums over every rank of the job, and
one bucketed gradient sum over the data-parallel ranks that hold the same stages."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fullbatch._base._sync._base import sum_tensors

__all__ = ["PipelineComm"]


class PipelineComm:
    """Sums for :class:`fullbatch.Pipeline`.

    ``group``: every rank of the job (data-parallel x pipeline stages), default the world;
    ``dp_group``: the ranks holding the same stages with other data (``None``: no DP).
    """

    def __init__(self, group: Any, dp_group: Any) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "fullbatch.Pipeline needs an initialized process group (pipeline stages live "
                "on different ranks): call dist.init_process_group() first."
            )
        self.group = group if group is not None else dist.group.WORLD
        self.dp_group = dp_group
        self.dp_world = 1 if dp_group is None else dist.get_world_size(dp_group)
        self._last_work: Any = None  # see Sync._wait: this thread frees finished work

    def sum(self, values: list[float]) -> list[float]:
        """Sum ``values`` over ``group``: one tiny all-reduce, one host synchronization."""
        flat = torch.tensor(values, dtype=torch.float64)
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        work.wait()
        self._last_work = work
        return flat.tolist()

    def sum_grads(self, grads: list[torch.Tensor]) -> None:
        """Sum gradients over the data-parallel ranks, in place (nothing without DP)."""
        if self.dp_world > 1 and grads:
            self._last_work = sum_tensors(grads, self.dp_group)

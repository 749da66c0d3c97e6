"""The collectives of a pipeline-parallel window: tiny sums over every rank of the job, and
one bucketed gradient sum over the data-parallel ranks that hold the same stages.

Stages ``fully_shard``'ed over the data-parallel ranks (pipeline x FSDP2, torchtitan's
layout) reduce their own gradients: FSDP2 reduce-scatters, averaged over its mesh. fullbatch
then sums nothing itself, undoes FSDP2's divisor in the step's one multiply, and each rank
adds the squared norm of its own shard (HSDP replicas their share).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fullbatch._base._sync._base import sum_tensors
from fullbatch._base._sync._fsdp import fsdp_divisor, is_fsdp

__all__ = ["PipelineComm"]


def _fsdp_facts(modules: Sequence[nn.Module], dp_group: Any) -> tuple[float, float] | None:
    """``(FSDP2's divisor, ranks holding each shard)`` of FSDP2 stages; None without FSDP2.

    Raises:
        ValueError: some stages sharded and others not, stages that divide differently, or
            a ``dp_group`` beside FSDP2 (which reduces over its own mesh).
    """
    sharded = [is_fsdp(m) or any(is_fsdp(s) for s in m.modules()) for m in modules]
    if not any(sharded):
        return None
    if not all(sharded):
        raise ValueError(
            "some pipeline stages on this rank are fully_shard'ed and others are not: "
            "fullbatch cannot both sum gradients itself and leave them to FSDP2. Shard every "
            "stage module over the data-parallel mesh, or none (and pass dp_group=)."
        )
    if dp_group is not None:
        raise ValueError(
            "dp_group= was given for fully_shard'ed pipeline stages: FSDP2 reduces their "
            "gradients over its own mesh, and summing them again over dp_group would count "
            "every item twice. Drop dp_group= (fullbatch undoes FSDP2's average itself)."
        )
    facts = {fsdp_divisor(m) for m in modules}
    if len(facts) > 1:
        raise ValueError(
            f"the fully_shard'ed pipeline stages divide gradients differently {sorted(facts)}: "
            "shard every stage over the same data-parallel mesh."
        )
    return facts.pop()


class PipelineComm:
    """Sums for :class:`fullbatch.Pipeline`.

    ``group``: every rank of the job (data-parallel x pipeline stages), default the world;
    ``dp_group``: the ranks holding the same stages with other data (``None``: no DP, or
    FSDP2 stages); ``stages``: this rank's stage modules (FSDP2 is read from them).
    """

    def __init__(self, group: Any, dp_group: Any, stages: Sequence[nn.Module] = ()) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "fullbatch.Pipeline needs an initialized process group (pipeline stages live "
                "on different ranks): call dist.init_process_group() first."
            )
        self.group = group if group is not None else dist.group.WORLD
        self.dp_group = dp_group
        self.dp_world = 1 if dp_group is None else dist.get_world_size(dp_group)
        fsdp = _fsdp_facts(stages, dp_group)
        # W: what FSDP2 divided the summed gradient by (1: fullbatch sums); shard copies.
        self.divisor, self.shard_copies = fsdp if fsdp is not None else (1.0, float(self.dp_world))
        self.sharded = fsdp is not None
        self._last_work: Any = None  # see Sync._wait: this thread frees finished work

    def sum(self, values: list[float]) -> list[float]:
        """Sum ``values`` over ``group``: one tiny all-reduce, one host synchronization."""
        flat = torch.tensor(values, dtype=torch.float64)
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        work.wait()
        self._last_work = work
        return flat.tolist()

    def sum_grads(self, grads: list[torch.Tensor]) -> None:
        """Sum gradients over the data-parallel ranks, in place (nothing without DP, nor
        under FSDP2, which reduced them in the schedule's last backward)."""
        if self.dp_world > 1 and grads and not self.sharded:
            self._last_work = sum_tensors(grads, self.dp_group)

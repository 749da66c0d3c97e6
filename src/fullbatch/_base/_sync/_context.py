"""Context parallelism beside the wrapper: which ranks count together, which ones average.

The ranks of a context-parallel (CP) group hold pieces of the same rows (e.g. each holds one
half of every sequence). Each rank counts and sums the loss of the items it holds, so an item
is counted exactly once when counts are summed over data-parallel x context-parallel ranks.
When the wrapper already reduces gradients over those ranks (DDP or FSDP2 over a flattened
``dp x cp`` mesh, as torchtitan shards), nothing changes. When the wrapper reduces over the
data-parallel ranks only, the counting group becomes DP x CP and fullbatch sums the gradients
over the CP group once per window, at ``step()`` (DDP; FSDP2 must shard over the flattened
``dp x cp`` mesh itself): the wrapper's divisor still applies.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fullbatch._base._sync._base import Sync

__all__ = ["attach_context_parallel"]


def attach_context_parallel(sync: Sync, cp_group: Any) -> None:
    """Make ``sync`` count over data-parallel x ``cp_group`` ranks and sum gradients over CP.

    Raises:
        ValueError: a local model, this rank not in ``cp_group``, or a ``cp_group`` that
            overlaps the wrapper's group only in part.
    """
    if sync.group is None:
        raise ValueError(
            "context_parallel= was given for a model that is not DDP-wrapped or fully_shard'ed; "
            "wrap the model over the data-parallel ranks (or over data x context ranks)."
        )
    cp_ranks = dist.get_process_group_ranks(cp_group)
    me = dist.get_rank()
    if me not in cp_ranks:
        raise ValueError(
            f"context_parallel= is a group of ranks {cp_ranks} that does not hold this rank "
            f"({me}); pass each rank its own context-parallel group."
        )
    dp_ranks = dist.get_process_group_ranks(sync.group)
    beside = not set(cp_ranks) <= set(dp_ranks)
    if beside and sync.sharded:
        raise ValueError(
            f"context_parallel= ranks {cp_ranks} lie beside the FSDP2 mesh (ranks {dp_ranks}): "
            "FSDP2 must reduce over the context-parallel ranks itself. Shard over the "
            "flattened data x context mesh, fully_shard(model, mesh=mesh['dp', "
            "'cp']._flatten()), as torchtitan does."
        )
    inside = set(cp_ranks) & set(dp_ranks)
    if not beside:
        return  # the wrapper reduces over the CP ranks already: counts and divisor are right
    if inside != {me}:
        raise ValueError(
            f"context_parallel= ranks {cp_ranks} overlap the wrapper's group {dp_ranks} in "
            f"{sorted(inside)}: the CP group must lie inside the wrapper's group (the wrapper "
            "averages over data x context ranks) or beside it (sharing only this rank)."
        )
    # Every CP rank's data-parallel ranks: their union is the counting group.
    mine = torch.tensor(dp_ranks, dtype=torch.int64)
    out = torch.empty(len(cp_ranks) * len(dp_ranks), dtype=torch.int64)
    # all_gather_single is the newer name of all_gather_into_tensor (torch >= 2.10).
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, mine, group=cp_group)
    union = sorted(set(out.tolist()))
    if len(union) != len(dp_ranks) * len(cp_ranks):
        raise ValueError(
            f"the data-parallel groups of the context-parallel ranks {cp_ranks} overlap "
            f"(together ranks {union}); each CP rank needs its own data-parallel group."
        )
    if union == list(range(dist.get_world_size())):
        sync.group = dist.group.WORLD
    else:
        sync.group = dist.new_group(union, use_local_synchronization=True)
    sync.context_group = cp_group

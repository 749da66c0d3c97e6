"""Everything that talks to ``torch.distributed``: the only package that imports it.

- ``_base``: :class:`Sync`, the no-op kind for local training, bucketed sums, and
  ``all_reduce_over`` for integrations whose framework owns the group;
- ``_ddp``: DDP (``ddp_sync="last"`` or ``"step"``);
- ``_fsdp``: FSDP2 over a 1-D mesh or a 2-D (replicate, shard) HSDP mesh
  (``fsdp_sync="window"``, ``"micro_batch"``, ``"hybrid"``);
- ``_context``: context-parallel ranks beside the data-parallel wrapper;
- ``_make``: :func:`make_sync`, which picks the kind for a model;
- ``_pipeline``: the sums of :class:`fullbatch.Pipeline` windows.
"""

from fullbatch._base._sync._base import Sync, all_reduce_over
from fullbatch._base._sync._make import make_sync

__all__ = ["Sync", "all_reduce_over", "make_sync"]

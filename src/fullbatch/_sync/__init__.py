"""Everything that talks to ``torch.distributed``: the only package that imports it.

- ``_base``: :class:`Sync`, the no-op kind for local training, and bucketed sums;
- ``_ddp``: DDP (``ddp_sync="last"`` or ``"step"``);
- ``_fsdp``: FSDP2 over a 1-D mesh or a 2-D (replicate, shard) HSDP mesh
  (``fsdp_sync="window"``, ``"micro_batch"``, ``"hybrid"``);
- ``_context``: context-parallel ranks beside the data-parallel wrapper;
- ``_make``: :func:`make_sync`, which picks the kind for a model.
"""

from fullbatch._sync._base import Sync
from fullbatch._sync._make import make_sync

__all__ = ["Sync", "make_sync"]

"""Everything that talks to ``torch.distributed``: the only package that imports it.

- ``_base``: :class:`Sync`, the no-op kind for local training, bucketed sums, and
  ``all_reduce_over`` / ``sum_over_ranks`` / ``gather_over_ranks`` for integrations whose
  framework owns the group;
- ``_ddp``: DDP (``ddp_sync="last"`` or ``"step"``);
- ``_fsdp``: FSDP2 over a 1-D mesh or a 2-D (replicate, shard) HSDP mesh
  (``fsdp_sync="window"``, ``"micro_batch"``, ``"hybrid"``);
- ``_context``: context-parallel ranks beside the data-parallel wrapper;
- ``_mesh``: :class:`MeshFacts`, which dims of a composed ``DeviceMesh`` carry data and which
  carry model (tensor-parallel) pieces: who counts items, the window's reduction group, and
  each gradient piece's share of the norm; for the probe, the same facts read from FSDP2's
  meshes without a collective;
- ``_make``: :class:`SyncPlan`, the sync options parsed once, which picks the kind for a model;
- ``_pipeline``: the sums of :class:`fullbatch.Pipeline` windows;
- ``_probe``: what :func:`fullbatch.probe` asks of ``torch.distributed`` (the wrapper around a
  module, the ranks of a probed window).
"""

from fullbatch._base._sync._base import Sync, all_reduce_over, gather_over_ranks, sum_over_ranks
from fullbatch._base._sync._make import DdpSync, FsdpSync, SyncPlan
from fullbatch._base._sync._mesh import MeshFacts, mesh_facts

__all__ = [
    "DdpSync",
    "FsdpSync",
    "MeshFacts",
    "Sync",
    "SyncPlan",
    "all_reduce_over",
    "gather_over_ranks",
    "mesh_facts",
    "sum_over_ranks",
]

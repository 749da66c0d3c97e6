"""The sync options, parsed once (:class:`SyncPlan`), and the :class:`Sync` they pick for a
model: local, DDP, FSDP2 (1-D or HSDP), CP beside them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fullbatch._base._sync._base import Sync
from fullbatch._base._sync._context import attach_context_parallel
from fullbatch._base._sync._ddp import DDP_SYNC_MODES, DDPSync, DdpSync
from fullbatch._base._sync._fsdp import FSDP_SYNC_MODES, FSDPSync, FsdpSync, is_fsdp
from fullbatch._base._sync._mesh import dtensor_meshes, mesh_facts, step_group
from fullbatch._base._versions import check_fsdp2_device
from fullbatch._base._warn import warn

__all__ = ["DdpSync", "FsdpSync", "SyncPlan"]


def _check_mode(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of {allowed}.")


@dataclass(kw_only=True, slots=True, frozen=True)
class SyncPlan:
    """How gradients and counts are combined over ranks: the Accumulator's sync options.

    Attributes:
        ddp_sync: DDP only. ``"last"``: each rank's last micro-batch synchronizes; ``"step"``:
            one bucketed all-reduce at ``step()``. ``None``: ``"step"`` with an ``"auto"``
            size (which needs it), else ``"last"``.
        fsdp_sync: FSDP2 only. ``None``: ``"hybrid"`` on a 2-D (HSDP) mesh, ``"window"`` on a
            1-D one.
        grad_divisor: what a custom DDP comm hook (or FSDP2 divide factor) divides by.
        process_group: checked against the wrapper's group.
        context_parallel: the context-parallel group beside the wrapper.
        data_mesh_dims: the dims of the DTensor parameters' mesh that hold different items,
            checked against what the wrapper reduces over (``None``: discovered). Every
            other dim of that mesh is a model (tensor-parallel) dim.

    >>> SyncPlan(ddp_sync="first")
    Traceback (most recent call last):
    ValueError: ddp_sync='first' is not one of ('last', 'step').
    >>> SyncPlan().make(nn.Linear(2, 1)).kind
    'local'
    """

    ddp_sync: DdpSync | None = None
    fsdp_sync: FsdpSync | None = None
    grad_divisor: float | None = None
    process_group: Any = None
    context_parallel: Any = None
    data_mesh_dims: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        dims = self.data_mesh_dims
        if dims is not None:
            if isinstance(dims, str) or not all(isinstance(d, str) for d in dims):
                raise ValueError(
                    f"data_mesh_dims must be a tuple of mesh dim names, got {dims!r}; e.g. "
                    "data_mesh_dims=('dp',)."
                )
            object.__setattr__(self, "data_mesh_dims", tuple(dims))
        if self.ddp_sync is not None:
            _check_mode("ddp_sync", self.ddp_sync, DDP_SYNC_MODES)
        if self.fsdp_sync is not None:
            _check_mode("fsdp_sync", self.fsdp_sync, FSDP_SYNC_MODES)
        if self.grad_divisor is not None and not self.grad_divisor > 0:
            raise ValueError(f"grad_divisor must be > 0, got {self.grad_divisor!r}.")

    def make(self, model: nn.Module, *, auto: str | None = None) -> Sync:
        """Inspect ``model`` and return the matching :class:`Sync`.

        ``auto``: the public name of an ``"auto"`` micro-batch size (``"micro_batch_size"``
        or ``"micro_batch_tokens"``), None without one.

        Raises:
            ValueError: ``"hybrid"`` on a 1-D mesh, ``ddp_sync="last"`` with an "auto" size
                under DDP, a ``process_group`` that is not the wrapper's group, a
                ``context_parallel`` group that does not fit, or a model whose ``.module``
                is the DDP/FSDP2 model (pass ``model.module``).
        """
        sync, wrapper = _make(model, self, auto)
        _attach_mesh(sync, model, wrapper, self.data_mesh_dims)
        return sync


def _attach_mesh(sync: Sync, model: nn.Module, wrapper: str, named: Any) -> None:
    """Model (tensor-parallel) dims beside the data dims: count over the data ranks, reduce
    the window's numbers over data x model ranks (:mod:`._mesh`)."""
    if named is None and not any(hasattr(p, "device_mesh") for p in model.parameters()):
        return  # no DTensor parameters: nothing to ask
    data = dist.get_process_group_ranks(sync.group) if sync.group is not None else []
    facts = mesh_facts(list(model.parameters()), data, wrapper=wrapper, data_mesh_dims=named)
    if facts is None:
        return
    if sync.context_group is not None:
        raise ValueError(
            "context_parallel= ranks beside the wrapper with tensor-parallel parameters: "
            "fullbatch does not combine the two. Flatten the context dim into FSDP2's mesh, "
            "fully_shard(model, mesh=mesh['dp', 'cp']._flatten()), as torchtitan does."
        )
    sync.attach_mesh(facts, step_group(facts, sync.group))


def _make(model: nn.Module, plan: SyncPlan, auto: str | None) -> tuple[Sync, str]:
    """The Sync for ``model`` and the wrapper's name (for messages)."""
    process_group, context_parallel = plan.process_group, plan.context_parallel
    sync: Sync
    if isinstance(model, DistributedDataParallel):
        sync, wrapper = DDPSync(model, plan.ddp_sync, plan.grad_divisor, auto=auto), "DDP"
    elif is_fsdp(model):
        check_fsdp2_device(model)  # FSDP2 on CPU needs torch >= 2.7
        sync, wrapper = FSDPSync(model, plan.fsdp_sync, plan.grad_divisor), "FSDP2"
    else:
        sync = Sync(model)
        inner = getattr(model, "module", None)
        if isinstance(inner, DistributedDataParallel) or is_fsdp(inner):
            kind = "DDP-wrapped" if isinstance(inner, DistributedDataParallel) else "fully_shard'ed"
            raise ValueError(
                f"the model is a {type(model).__name__} whose .module is {kind}: fullbatch "
                "controls the gradient sync of the model it is given, so here it would count "
                "items on this rank only while the inner model synchronizes on its own (every "
                "step wrong when ranks count differently). Pass the inner model: "
                "fb.Accumulator(model.module, optimizer, ...), and keep calling model(...) if "
                "its forward calls model.module."
            )
        elif (
            dist.is_available()
            and dist.is_initialized()
            and dist.get_world_size() > 1
            and not _tensor_parallel_world(model)
        ):
            warn(
                "a process group is initialized but the model is neither DDP-wrapped nor "
                "fully_shard'ed: fullbatch counts items on this rank only (W = 1). Wrap the "
                "model so that counts and gradients are combined over ranks."
            )
        if process_group is not None:
            raise ValueError(
                "process_group was given for a model that is not DDP-wrapped or "
                "fully_shard'ed; the group is taken from the wrapper. Wrap the model, or drop "
                "process_group."
            )
        if context_parallel is not None:
            attach_context_parallel(sync, context_parallel)  # raises: nothing to count over
        return sync, "no wrapper"
    if process_group is not None and process_group != sync.group:
        ranks = dist.get_process_group_ranks(sync.group)
        raise ValueError(
            f"process_group={process_group!r} is not the wrapper's data-parallel group "
            f"(ranks {ranks}). fullbatch counts items over the group the wrapper reduces "
            "gradients over; drop process_group= or wrap the model with that group."
        )
    if context_parallel is not None:
        attach_context_parallel(sync, context_parallel)
    return sync, wrapper


def _tensor_parallel_world(model: nn.Module) -> bool:
    """Whether the model's DTensor parameters span every rank (tensor parallelism alone: the
    ranks hold pieces of one model over the same items, nothing to count over)."""
    meshes = dtensor_meshes(list(model.parameters()))
    return bool(meshes) and max(m.size() for m in meshes) == dist.get_world_size()

"""Pick the :class:`Sync` for a model: local, DDP, FSDP2 (1-D or HSDP), CP beside them."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fullbatch._base._sync._base import Sync
from fullbatch._base._sync._context import attach_context_parallel
from fullbatch._base._sync._ddp import DDPSync
from fullbatch._base._sync._fsdp import FSDP_SYNC_MODES, FSDPSync, is_fsdp
from fullbatch._base._versions import check_fsdp2_device
from fullbatch._base._warn import warn

__all__ = ["make_sync"]

DDP_SYNC_MODES = ("last", "step")


def _check_mode(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of {allowed}.")


def make_sync(
    model: nn.Module,
    *,
    process_group: Any = None,
    ddp_sync: str = "last",
    fsdp_sync: str | None = None,
    grad_divisor: float | None = None,
    context_parallel: Any = None,
) -> Sync:
    """Inspect ``model`` and return the matching :class:`Sync`.

    ``fsdp_sync=None`` is ``"hybrid"`` on a 2-D (HSDP) mesh and ``"window"`` on a 1-D one.

    Raises:
        ValueError: an unknown mode, ``"hybrid"`` on a 1-D mesh, a ``process_group`` that is
            not the wrapper's group, a ``context_parallel`` group that does not fit, or a
            model whose ``.module`` is the DDP/FSDP2 model (pass ``model.module``).
    """
    _check_mode("ddp_sync", ddp_sync, DDP_SYNC_MODES)
    if fsdp_sync is not None:
        _check_mode("fsdp_sync", fsdp_sync, FSDP_SYNC_MODES)
    if grad_divisor is not None and not grad_divisor > 0:
        raise ValueError(f"grad_divisor must be > 0, got {grad_divisor!r}.")
    sync: Sync
    if isinstance(model, DistributedDataParallel):
        sync = DDPSync(model, ddp_sync, grad_divisor)
    elif is_fsdp(model):
        check_fsdp2_device(model)  # FSDP2 on CPU needs torch >= 2.7
        sync = FSDPSync(model, fsdp_sync, grad_divisor)
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
        elif dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
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
        return sync
    if process_group is not None and process_group != sync.group:
        ranks = dist.get_process_group_ranks(sync.group)
        raise ValueError(
            f"process_group={process_group!r} is not the wrapper's data-parallel group "
            f"(ranks {ranks}). fullbatch counts items over the group the wrapper reduces "
            "gradients over; drop process_group= or wrap the model with that group."
        )
    if context_parallel is not None:
        attach_context_parallel(sync, context_parallel)
    return sync

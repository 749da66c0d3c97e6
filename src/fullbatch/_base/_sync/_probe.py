"""What the probe asks of ``torch.distributed``: which wrapper a module runs under, and the
ranks whose micro-batches make one probed window.

The probe (``fullbatch._probe``) never imports ``torch.distributed`` itself: it asks here whether
a module is a DDP wrapper (transparent: its inner module is what runs), an engine that keeps
gradients outside ``.grad`` and that no reader of the probe reads (refused by name: FSDP1,
ColossalAI; DeepSpeed and FSDP2 have their own readers), and for the :class:`Sync` whose
collectives sum the window over its ranks. On a composed mesh (tensor parallel ``DTensor``
parameters, alone or under FSDP2/HSDP) it says which ranks hold other data
(:func:`data_ranks`, :func:`mesh_group`) and which parameters are tensor-parallel
(:func:`tensor_parallel`): the mesh facts themselves are ``_mesh``'s, given FSDP2's meshes.
"""

from __future__ import annotations

import gc
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fullbatch._base._sync._base import Sync, sum_tensors
from fullbatch._base._sync._fsdp import fsdp_meshes, is_fsdp, registered_params, unsharded_params
from fullbatch._base._sync._mesh import has_model_dims, mesh_group, window_ranks

__all__ = [
    "data_ranks",
    "default_rank",
    "is_ddp",
    "is_fsdp",
    "mesh_group",
    "probe_sync",
    "registered_params",
    "release_process_group",
    "sum_tensors",
    "tensor_parallel",
    "unsharded_params",
    "unsupported_wrapper",
]

# Engines whose gradients are not the parameters' ``.grad`` when ``step()`` is called and that
# no reader of the probe reads, by the class name of their model wrapper (none is imported here).
_OUTSIDE_GRAD = {
    "FullyShardedDataParallel": "FSDP1 (FullyShardedDataParallel) keeps gradients in flat "
    "parameters, not in each parameter's .grad",
    "GeminiDDP": "ColossalAI Gemini keeps gradients in its chunks, not in each parameter's .grad",
    "LowLevelZeroModel": "ColossalAI ZeRO keeps gradients in its own buckets, not in each "
    "parameter's .grad",
}


def is_ddp(module: nn.Module) -> bool:
    """Whether ``module`` is a ``DistributedDataParallel`` wrapper.

    >>> is_ddp(nn.Linear(1, 1))
    False
    """
    return isinstance(module, DistributedDataParallel)


def unsupported_wrapper(module: nn.Module) -> str | None:
    """Why the probe cannot check a model wrapped by ``module``, or ``None`` when it can.

    >>> unsupported_wrapper(nn.Linear(1, 1)) is None
    True
    """
    for cls in type(module).__mro__:
        if cls.__name__ in _OUTSIDE_GRAD:
            return _OUTSIDE_GRAD[cls.__name__]
    return None


def probe_sync(wrapper: nn.Module | None, ranks: Any) -> Sync:
    """The :class:`Sync` over the ranks whose micro-batches make one window.

    ``ranks="local"``: this process alone. A process group: that group. ``None``: the DDP
    wrapper's group when the model ran under one; else the default group when one is
    initialized with more than one rank (a hand loop that all-reduces gradients itself); else
    this process alone.

    >>> probe_sync(None, None).world
    1
    """
    sync = Sync(wrapper if wrapper is not None else nn.Module())
    if isinstance(ranks, str):
        if ranks != "local":
            raise ValueError(
                f"ranks={ranks!r}: pass None (inferred), 'local' (this process alone) or a "
                "torch.distributed process group."
            )
        return sync
    if ranks is not None:
        sync.group = ranks
    elif wrapper is not None and is_ddp(wrapper):
        sync.group = wrapper.process_group
    elif dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        sync.group = dist.group.WORLD
    return sync


def default_rank() -> int | None:
    """This process's rank in the default process group, or None when there is none (the
    probe's command prints its report on rank 0 alone).

    >>> default_rank() is None
    True
    """
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return None


def release_process_group() -> None:
    """Destroy the default process group a finished script left up, if there is one. Exiting
    with it alive lets Gloo's worker threads abort the interpreter's teardown now and then
    (SIGABRT: "terminate called without an active exception"), and torchrun then reports that
    rank's abort in place of the probe's exit status.

    The script's objects (a DDP module's reducer holds the group) are collected first, so
    the group is freed now, while the interpreter is whole, not during its teardown.

    >>> release_process_group()  # no group: nothing to do
    """
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
        gc.collect()


def tensor_parallel(params: tuple[nn.Parameter, ...], modules: tuple[nn.Module, ...]) -> bool:
    """Whether one of ``params`` lies on a tensor-parallel mesh dim (:func:`has_model_dims` of
    ``modules``' FSDP2 meshes).

    >>> import torch
    >>> tensor_parallel((nn.Parameter(torch.ones(1)),), ())
    False
    """
    return has_model_dims(params, fsdp_meshes(modules))


def data_ranks(params: tuple[nn.Parameter, ...], modules: tuple[nn.Module, ...]) -> Any:
    """Which ranks' micro-batches make one probed window (:func:`window_ranks` of ``modules``'
    FSDP2 meshes).

    >>> import torch
    >>> data_ranks((nn.Parameter(torch.ones(1)),), ())
    'local'
    """
    return window_ranks(params, fsdp_meshes(modules))

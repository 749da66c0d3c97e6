"""FSDP2 over a 1-D mesh (shard) or a 2-D mesh (replicate, shard: HSDP).

Every forward all-gathers, so ranks run the same number of micro-batches. Per micro-batch the
wrapper's flags decide what communicates (torch 2.6-2.13 ``FSDPModule``):

============== ============================== ==========================================
``fsdp_sync``  non-final micro-batch           held between micro-batches (per rank)
============== ============================== ==========================================
``window``     nothing                         the unsharded gradients (model size)
``micro_batch`` reduce-scatter (+ all-reduce)   the sharded ``.grad`` (model / shard)
``hybrid``     reduce-scatter only (HSDP)      FSDP2's partial shard (model / shard)
============== ============================== ==========================================

The final micro-batch always reduce-scatters and, under HSDP, all-reduces over the replicas.
``set_requires_gradient_sync(True)`` also turns the cross-replica all-reduce back on, so the
flags are set in that order: gradient sync first, ``set_requires_all_reduce`` after it.
"""

from __future__ import annotations

import sys
from typing import Any, Literal, get_args

import torch.distributed as dist
from torch import nn

from fullbatch._base._sync._base import Sync

__all__ = [
    "FSDP_SYNC_MODES",
    "FSDPSync",
    "FsdpSync",
    "fsdp_divisor",
    "fsdp_mesh",
    "fsdp_meshes",
    "is_fsdp",
    "registered_params",
    "unsharded_params",
]

FsdpSync = Literal["window", "micro_batch", "hybrid"]
FSDP_SYNC_MODES: tuple[str, ...] = get_args(FsdpSync)


def fsdp_mesh(model: nn.Module) -> Any:
    """FSDP2's own data-parallel mesh (1-D shard or 2-D replicate x shard; ValueError if the
    model has no DTensor parameters).

    Read from FSDP2's parameter groups (``mesh_info.mesh``): under FSDP2 x tensor parallelism
    a parameter's mesh also has the model dims (``(dp, tp)``), which FSDP2 does not reduce
    over. Without parameter groups, the parameters' mesh.
    """
    meshes = [g.mesh_info.mesh for g in _param_groups(model) if hasattr(g, "mesh_info")]
    if meshes:
        return meshes[0]
    mesh = next((p.device_mesh for p in model.parameters() if hasattr(p, "device_mesh")), None)
    if mesh is None:
        raise ValueError("the FSDP2 model has no DTensor parameters: call fully_shard first.")
    return mesh


def is_fsdp(module: Any) -> bool:
    """Whether ``module`` is ``fully_shard``'ed (an ``FSDPModule``).

    Read from ``sys.modules`` instead of importing ``torch.distributed.fsdp``: that import
    costs about 1 s of CPU (it pulls ``torch.export`` and ``sympy``), and a model that was
    ``fully_shard``'ed has had it imported by its user (``benchmarks/import_time.py``).
    """
    fsdp = sys.modules.get("torch.distributed.fsdp")
    cls = getattr(fsdp, "FSDPModule", None)
    return cls is not None and isinstance(module, cls)


def _fsdp_modules(model: nn.Module) -> list[Any]:
    return [m for m in model.modules() if is_fsdp(m)]


def _param_groups(model: nn.Module) -> list[Any]:
    """FSDP2's parameter groups (private ``FSDPParamGroup`` objects, torch 2.6-2.13)."""
    groups: list[Any] = []
    for module in _fsdp_modules(model):
        state = module._get_fsdp_state()
        plural = getattr(state, "_fsdp_param_groups", None)  # torch >= 2.11
        single = getattr(state, "_fsdp_param_group", None) if plural is None else None
        groups.extend(plural if plural is not None else [single] if single is not None else [])
    return groups


def fsdp_meshes(modules: tuple[nn.Module, ...]) -> dict[int, Any]:
    """FSDP2's data mesh (the mesh ``fully_shard`` was given) per sharded parameter's id."""
    out: dict[int, Any] = {}
    for top in modules:
        for group in _param_groups(top):
            for fsdp_param in getattr(group, "fsdp_params", []):
                out[id(fsdp_param.sharded_param)] = fsdp_param.mesh_info.mesh
    return out


def unsharded_params(model: nn.Module) -> dict[int, nn.Parameter]:
    """The tensor FSDP2's forward uses for each sharded parameter of ``model`` (by the id of
    the sharded ``DTensor`` parameter): its unsharded parameter, kept by FSDP2 from the first
    all-gather on (its storage freed between forwards and gathered again for each), so that
    ``torch.autograd.grad`` of a forward's loss with respect to it is this rank's whole
    gradient, before any reduce-scatter. Parameters not yet gathered are left out."""
    out: dict[int, nn.Parameter] = {}
    for group in _param_groups(model):
        for fsdp_param in getattr(group, "fsdp_params", []):
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None:
                out[id(fsdp_param.sharded_param)] = unsharded
    return out


def registered_params(model: nn.Module) -> list[nn.Parameter]:
    """``model``'s parameters as an optimizer built on it holds them: where FSDP2 left a module
    unsharded (its root after a no-grad forward, which no backward reshards), ``parameters()``
    yields the unsharded tensors in place of the sharded ``DTensor`` ones; each is mapped back
    to its sharded parameter. Any other model: ``list(model.parameters())``."""
    back: dict[int, nn.Parameter] = {}
    for group in _param_groups(model):
        for fsdp_param in getattr(group, "fsdp_params", []):
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None:
                back[id(unsharded)] = fsdp_param.sharded_param
    return [back.get(id(p), p) for p in model.parameters()]


def _divide_factor(model: nn.Module, default: float) -> float:
    """What FSDP2 divides the summed gradients by: ``set_gradient_divide_factor`` or default."""
    factors = {getattr(g, "gradient_divide_factor", None) for g in _param_groups(model)}
    if len(factors) > 1:
        shown = sorted(str(f) for f in factors)
        raise ValueError(
            f"the FSDP2 modules divide gradients by different factors {shown} "
            "(set_gradient_divide_factor on some modules only): fullbatch undoes one divisor. "
            "Call set_gradient_divide_factor with the same value on every FSDP module."
        )
    factor = factors.pop() if factors else None
    return float(default if factor is None else factor)


def fsdp_divisor(
    model: nn.Module, divisor: float | None = None, mesh: Any = None
) -> tuple[float, float]:
    """``(what FSDP2 divides the summed gradient by, ranks holding each gradient shard)``.

    FSDP2 averages over shard x replicate ranks unless ``set_gradient_divide_factor`` says
    otherwise (``divisor``, when given, wins); HSDP's replicas each hold the same shard.
    """
    mesh = mesh if mesh is not None else fsdp_mesh(model)
    shards = mesh.size(mesh.ndim - 1)
    replicas = mesh.size(0) if mesh.ndim == 2 else 1
    return float(divisor or _divide_factor(model, shards * replicas)), float(replicas)


def _mesh_group(mesh: Any) -> Any:
    """One process group over every rank of ``mesh`` (the counting group)."""
    ranks = sorted(int(r) for r in mesh.mesh.flatten().tolist())
    if ranks == list(range(dist.get_world_size())):
        return dist.group.WORLD
    return dist.new_group(ranks, use_local_synchronization=True)


class FSDPSync(Sync):
    kind = "fsdp2"
    sharded = True
    equal_micro_batches = True
    syncs_in_backward = True  # the last backward reduce-scatters; every backward may all-gather

    def __init__(
        self, model: nn.Module, mode: str | None, divisor: float | None, *, mesh: Any = None
    ) -> None:
        super().__init__(model)
        mesh = mesh if mesh is not None else fsdp_mesh(model)
        if mesh.ndim not in (1, 2):
            raise ValueError(
                f"fullbatch supports FSDP2 over a 1-D (shard) or 2-D (replicate, shard) device "
                f"mesh; got a {mesh.ndim}-D mesh {mesh}. Flatten the data-parallel dimensions."
            )
        self.hsdp = mesh.ndim == 2
        if mode is None:
            mode = "hybrid" if self.hsdp else "window"
        if mode == "hybrid" and not self.hsdp:
            raise ValueError(
                "fsdp_sync='hybrid' defers the cross-replica all-reduce of HSDP, but the model "
                f"is sharded over a 1-D mesh {mesh} (no replicas). Use fsdp_sync='window' "
                "(reduce-scatter once per window) or fsdp_sync='micro_batch' (every "
                "micro-batch, less memory)."
            )
        self.mode = mode
        self.shard_group = mesh.get_group(mesh.ndim - 1)
        self.replicate_group = mesh.get_group(0) if self.hsdp else None
        self.group = mesh.get_group() if not self.hsdp else _mesh_group(mesh)
        self.divisor, self.norm_copies = fsdp_divisor(model, divisor, mesh)

    def held_grads(self) -> str | None:
        if self.mode == "micro_batch":
            return None
        what = "unsharded gradients" if self.mode == "window" else "partial (un-all-reduced) shards"
        return (
            f"with FSDP2 and fsdp_sync={self.mode!r}: FSDP2 holds the window's {what} itself "
            "until the last micro-batch, out of a state's reach. Build the Accumulator with "
            "fsdp_sync='micro_batch' (each micro-batch's gradient is reduce-scattered into the "
            "sharded .grad, which the state holds)"
        )

    def begin(self, final: bool) -> None:
        # Order matters: set_requires_gradient_sync(True) also re-enables the all-reduce.
        sync = final or self.mode in ("micro_batch", "hybrid")
        self.model.set_requires_gradient_sync(sync)
        if self.hsdp and sync and not final and self.mode == "hybrid":
            self.model.set_requires_all_reduce(False)
        self.model.set_is_last_backward(final)

    def end(self) -> None:
        self.model.set_requires_gradient_sync(True)  # both reductions back on
        self.model.set_is_last_backward(True)

    def forward_collective_modules(self) -> list[nn.Module]:
        # Every FSDP2 module all-gathers its parameters before its forward.
        return [m for m in _fsdp_modules(self.model) if isinstance(m, nn.Module)]

    def drop_unreduced_grads(self) -> None:
        # Without gradient sync, FSDP2 accumulates unsharded gradients on its own FSDPParam
        # objects; with the all-reduce deferred (HSDP "hybrid"), a partial shard on the
        # parameter group (private in torch 2.6-2.13); zero_grad() reaches neither.
        for group in _param_groups(self.model):
            if hasattr(group, "_partial_reduce_output"):
                group._partial_reduce_output = None
            for fsdp_param in getattr(group, "fsdp_params", []):
                fsdp_param.unsharded_accumulated_grad = None
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded is not None:
                    unsharded.grad = None

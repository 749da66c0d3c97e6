"""Mesh facts: which ranks of a composed ``DeviceMesh`` carry data, which carry model pieces.

A composed mesh (torchtitan's ``dp x tp``, ``dp_replicate x dp_shard x tp``) has two kinds of
dimensions. *Data* dims hold different items: the meshes and groups FSDP2 and DDP reduce
gradients over (with a context-parallel dim flattened into them). *Model* dims hold other
pieces of the same model over the same items: every other dim of a DTensor parameter's mesh
(tensor parallelism). So item counts and loss sums are summed over data ranks only, while the
gradient norm is summed over data x model ranks, each gradient piece counted once.

:func:`mesh_facts` decides this once, from the model (no argument needed), or checks an
explicit ``data_mesh_dims``; the engine's refusals ask its :class:`MeshFacts`, never
re-derive it. The probe, which watches a loop without a wrapper to ask, reads the same facts
without a collective from FSDP2's meshes: :func:`has_model_dims`, :func:`window_ranks`,
:func:`mesh_group`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fullbatch._base._normalize import squared_norm

__all__ = [
    "MeshFacts",
    "dtensor_meshes",
    "has_model_dims",
    "mesh_facts",
    "mesh_group",
    "step_group",
    "window_ranks",
]


@dataclass(frozen=True, slots=True)
class MeshFacts:
    """This rank's place on the parameters' mesh.

    Attributes:
        data_dims: the dims of the parameters' mesh that hold different items.
        model_dims: the dims that hold other pieces of the same model (tensor parallel).
        data_ranks: the ranks counting items together with this one (the wrapper's group).
        model_ranks: the ranks holding the other pieces of this rank's model replica.
        step_ranks: data x model ranks: the ranks of the window's one reduction.
        counts_here: whether this rank adds its counts and loss sums (the first of its
            model ranks: the others hold the same items).
    """

    data_dims: tuple[str, ...]
    model_dims: tuple[str, ...]
    data_ranks: tuple[int, ...]
    model_ranks: tuple[int, ...]
    step_ranks: tuple[int, ...]
    counts_here: bool

    def copies(self, grad: torch.Tensor) -> float:
        """How many step ranks hold the same values as this rank's piece of ``grad``.

        A DTensor's Replicate dims each multiply it; ranks of the step group outside the
        gradient's mesh hold the same piece (same model piece, data already reduced), and a
        plain tensor is the same on every step rank.

        Raises:
            ValueError: a gradient with a Partial placement (not yet reduced).
        """
        mesh = getattr(grad, "device_mesh", None)
        if mesh is None:
            return float(len(self.step_ranks))
        placements = grad.placements  # type: ignore[attr-defined]
        if any(p.is_partial() for p in placements):
            raise ValueError(
                f"a gradient on mesh {mesh} has placements {placements} with a Partial dim: "
                "it is not reduced yet, so its norm is not the full gradient's. Redistribute "
                "the parameter's gradient to its own placements before the step."
            )
        replicated = math.prod(mesh.size(d) for d, p in enumerate(placements) if p.is_replicate())
        return replicated * len(self.step_ranks) / mesh.size()

    def norm_share(self, grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
        """This rank's share of the full gradient's squared norm: summed over the step ranks
        it is the full gradient's, every shard counted once and no replicated piece twice."""
        by_copies: dict[float, list[torch.Tensor]] = {}
        for g in grads:
            by_copies.setdefault(self.copies(g), []).append(g)
        total = torch.zeros((), dtype=torch.float64, device=device)
        for copies, group in by_copies.items():
            total = total + squared_norm(group, device).to(total.dtype) / copies
        return total


def dtensor_meshes(params: Sequence[torch.Tensor]) -> list[Any]:
    """The distinct device meshes of the DTensor parameters in ``params``, in order."""
    meshes: list[Any] = []
    for p in params:
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None and not any(mesh == m for m in meshes):
            meshes.append(mesh)
    return meshes


def _line(mesh: Any, dim: int, coord: list[int]) -> set[int]:
    """The ranks of ``mesh`` along ``dim`` through ``coord``."""
    index: list[Any] = list(coord)
    index[dim] = slice(None)
    return {int(r) for r in mesh.mesh[tuple(index)].reshape(-1).tolist()}


def _names(mesh: Any) -> list[str]:
    names = mesh.mesh_dim_names
    return list(names) if names is not None else [f"dim{d}" for d in range(mesh.ndim)]


def _classify(mesh: Any, data: set[int], me: int) -> tuple[list[int], list[int]]:
    """``(data dims, model dims)`` of ``mesh`` for a rank whose data ranks are ``data``."""
    coord = mesh.get_coordinate()
    data_dims: list[int] = []
    model_dims: list[int] = []
    for d in range(mesh.ndim):
        line = _line(mesh, d, coord)
        if line <= data:
            data_dims.append(d)
        elif line & data == {me}:
            model_dims.append(d)
        else:
            raise ValueError(
                f"dim {_names(mesh)[d]!r} of the parameters' mesh {mesh} (ranks {sorted(line)} "
                f"here) overlaps the data-parallel ranks {sorted(data)} only in part: it holds "
                "neither the same items (a model dim) nor only the ranks the wrapper reduces "
                "over (a data dim), so fullbatch cannot tell which items to count. Shard or "
                "replicate the model over whole mesh dims: fully_shard(model, mesh=mesh['dp'])."
            )
    return data_dims, model_dims


def _sub_ranks(mesh: Any, dims: list[int]) -> set[int]:
    """The ranks of ``mesh`` that differ from this rank's coordinate only along ``dims``."""
    index: list[Any] = list(mesh.get_coordinate())
    for d in dims:
        index[d] = slice(None)
    return {int(r) for r in mesh.mesh[tuple(index)].reshape(-1).tolist()}


def mesh_facts(
    params: Sequence[torch.Tensor],
    data_ranks: Sequence[int],
    *,
    wrapper: str,
    data_mesh_dims: Sequence[str] | None = None,
) -> MeshFacts | None:
    """The mesh facts of a model whose DTensor parameters are ``params``; None without model
    dims (no DTensor parameters, or meshes of data dims only: nothing changes).

    ``data_ranks``: the ranks the wrapper counts with (this rank alone without a wrapper);
    ``wrapper``: its name for messages (``"FSDP2"``, ``"DDP"``, ``"no wrapper"``);
    ``data_mesh_dims``: the dims the user says hold data, checked against discovery.

    Raises:
        ValueError: a mesh dim that is partly data and partly model; DDP with tensor-parallel
            DTensor parameters; data ranks beside the parameters' mesh; ``data_mesh_dims``
            that differ from what the wrapper reduces over.
    """
    meshes = dtensor_meshes(params)
    me = dist.get_rank() if meshes else 0
    data = set(data_ranks) | {me}
    found: list[tuple[Any, list[int], list[int]]] = []
    for mesh in meshes:
        if mesh.get_coordinate() is None:
            continue  # a parameter on a mesh without this rank holds nothing here
        data_dims, model_dims = _classify(mesh, data, me)
        found.append((mesh, data_dims, model_dims))
    bearing = [f for f in found if f[2]]
    if data_mesh_dims is not None:
        _check_named(data_mesh_dims, bearing or found, wrapper)
    if not bearing:
        return None
    if wrapper == "DDP":
        raise ValueError(
            "the model is DDP-wrapped and has tensor-parallel DTensor parameters (model dims "
            f"{[_names(m)[d] for m, _, ds in bearing for d in ds]}): fullbatch does not make "
            "DDP over DTensor parameters exact. Shard or replicate with FSDP2 on the data "
            "dims instead: fully_shard(model, mesh=mesh['dp'])."
        )
    mesh, data_dims, model_dims = max(bearing, key=lambda f: f[0].size())
    model = _sub_ranks(mesh, model_dims)
    for other, _, dims in bearing:
        if not _sub_ranks(other, dims) <= model:
            raise ValueError(
                f"the DTensor parameters' meshes {mesh} and {other} disagree on which ranks "
                "hold the other pieces of this rank's model; put every tensor-parallel "
                "parameter on one mesh."
            )
    mesh_ranks = {int(r) for r in mesh.mesh.reshape(-1).tolist()}
    if not data <= mesh_ranks:
        raise ValueError(
            f"the data-parallel ranks {sorted(data)} lie beside the tensor-parallel mesh {mesh}: "
            "fullbatch needs the data dims on the parameters' mesh to count each item once. "
            "Build one DeviceMesh with both (init_device_mesh(..., mesh_dim_names=('dp', 'tp'))) "
            "and shard over its 'dp' dim."
        )
    names = _names(mesh)
    step = sorted(_sub_ranks(mesh, data_dims + model_dims))
    return MeshFacts(
        data_dims=tuple(names[d] for d in data_dims),
        model_dims=tuple(names[d] for d in model_dims),
        data_ranks=tuple(sorted(data)),
        model_ranks=tuple(sorted(model)),
        step_ranks=tuple(step),
        counts_here=all(mesh.get_coordinate()[d] == 0 for d in model_dims),
    )


def _check_named(
    named: Sequence[str], found: list[tuple[Any, list[int], list[int]]], wrapper: str
) -> None:
    """``data_mesh_dims`` must name exactly the dims the wrapper reduces over."""
    if not found:
        raise ValueError(
            f"data_mesh_dims={tuple(named)!r} names dims of a DTensor mesh, but the model has "
            "no DTensor parameters on this rank; drop data_mesh_dims."
        )
    mesh, data_dims, _ = found[0]
    names = _names(mesh)
    unknown = [n for n in named if n not in names]
    if unknown:
        raise ValueError(
            f"data_mesh_dims={tuple(named)!r}: the parameters' mesh {mesh} has no dims "
            f"{unknown} (its dims: {names})."
        )
    discovered = sorted(names[d] for d in data_dims if mesh.size(d) > 1)
    wanted = sorted(n for n in named if mesh.size(names.index(n)) > 1)
    if wanted != discovered:
        key = repr(named[0]) if len(named) == 1 else repr(tuple(named))
        raise ValueError(
            f"data_mesh_dims={tuple(named)!r}, but {wrapper} reduces gradients over the dims "
            f"{discovered} of the parameters' mesh {mesh}: counting items over other dims than "
            "the gradients are reduced over would not be the full batch. Wrap the model over "
            f"the data dims (fully_shard(model, mesh=mesh[{key}])) or drop "
            "data_mesh_dims."
        )


def step_group(facts: MeshFacts, data_group: Any, mesh_groups: Sequence[Any] = ()) -> Any:
    """A process group over ``facts.step_ranks``: the world, the data group, a group in
    ``mesh_groups`` (a mesh dim's own) with exactly those ranks, or a new one."""
    ranks = list(facts.step_ranks)
    if ranks == list(range(dist.get_world_size())):
        return dist.group.WORLD
    for group in [data_group, *mesh_groups]:
        if group is not None and sorted(dist.get_process_group_ranks(group)) == ranks:
            return group
    return dist.new_group(ranks, use_local_synchronization=True)


def has_model_dims(params: Sequence[torch.Tensor], fsdp_meshes: dict[int, Any]) -> bool:
    """Whether one of ``params`` is a ``DTensor`` on a mesh dim that is not FSDP2's (a
    tensor-parallel dim: its ranks see the same micro-batches). ``fsdp_meshes``: FSDP2's mesh
    per sharded parameter's id."""
    for p in params:
        mesh = getattr(p, "device_mesh", None)
        if mesh is None:
            continue
        data = fsdp_meshes.get(id(p))
        if data is None or mesh.ndim > data.ndim:
            return True
    return False


def window_ranks(params: Sequence[torch.Tensor], fsdp_meshes: dict[int, Any]) -> Any:
    """Which ranks' micro-batches make one window of a tensor-parallel model, said without a
    collective: FSDP2's mesh (every one of its dims: HSDP's replicate and shard; a process
    group for it is :func:`mesh_group`'s), ``"local"`` where no FSDP2 shards the model and its
    ``DTensor`` meshes span every rank (tensor parallelism alone), or None when neither says (a
    mesh with other ranks beside it, whose data parallelism the loop does itself)."""
    meshes = {id(m): m for m in fsdp_meshes.values()}
    if len(meshes) > 1:
        return None  # modules sharded over different meshes: not one data group
    if meshes:
        return next(iter(meshes.values()))
    spans = {mesh.size() for mesh in dtensor_meshes(params)}
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return "local" if spans <= {world} else None


def mesh_group(ranks: Any) -> Any:
    """A process group over every rank of a ``DeviceMesh`` (a 2-D one flattened, once: the
    mesh caches it), or ``ranks`` itself when it is not a mesh (a group, ``"local"``)."""
    if not hasattr(ranks, "get_group") or not hasattr(ranks, "ndim"):
        return ranks
    if ranks.ndim == 1:
        return ranks.get_group()
    flatten = getattr(ranks, "_flatten", None)
    if not callable(flatten):
        raise RuntimeError(
            f"the probe needs one process group over FSDP2's {ranks.ndim}-D mesh {ranks}, and "
            "this torch's DeviceMesh has no _flatten(); pass fb.probe(ranks=<that group>)."
        )
    return flatten().get_group()

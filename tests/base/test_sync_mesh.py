"""Mesh facts without a process group: the option's form, a name without DTensor parameters,
and each gradient piece's share of the norm (the distributed cases are in
tests/distributed/test_distributed_meshes.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fullbatch as fb
from fullbatch._base._sync import SyncPlan
from fullbatch._base._sync._mesh import MeshFacts


def test_data_mesh_dims_must_be_a_tuple_of_names() -> None:
    with pytest.raises(ValueError, match=r"data_mesh_dims must be a tuple of mesh dim names"):
        SyncPlan(data_mesh_dims="dp")  # type: ignore[arg-type]
    assert SyncPlan(data_mesh_dims=["dp"]).data_mesh_dims == ("dp",)  # type: ignore[arg-type]


def test_data_mesh_dims_without_dtensor_parameters_is_refused() -> None:
    model = nn.Linear(2, 1)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"no DTensor parameters on this rank; drop"):
        fb.Accumulator(model, opt, micro_batches=2, data_mesh_dims=("dp",))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_plain_gradients_count_once_over_the_step_ranks() -> None:
    """A plain tensor is the same on every step rank: each of 4 adds a quarter."""
    facts = MeshFacts(("dp",), ("tp",), (0, 2), (0, 1), (0, 1, 2, 3), True)
    grads = [torch.full((3,), 2.0), torch.ones(4)]
    assert facts.copies(grads[0]) == 4.0
    share = facts.norm_share(grads, torch.device("cpu"))
    assert float(share) * 4 == pytest.approx(12.0 + 4.0)

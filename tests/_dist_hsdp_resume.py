"""HSDP (2 x 2 mesh) resume, a rank function run inside ``_dist_scale.scale_cases``' single
4-process group: each rank trains once uninterrupted, once stopped (model and optimizer saved
with ``torch.distributed.checkpoint`` as docs/checkpointing.md shows, the Accumulator's state
per rank), then rebuilds fresh objects from another initialization, loads the states and
finishes. The parent compares the two final parameters (bitwise on CPU)."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import fullbatch as fb
from _dist_cases import _full_params, make_optimizer, micro_batch
from _resume_cases import _loop, _roundtrip

# name -> (Accumulator options, stop): ``(window, micro-batches done | None)``. Under "hybrid"
# and "window" FSDP2 holds gradients outside ``.grad`` mid-window (the state is refused: see
# the "state_error" checks), so they resume at a window boundary; "micro_batch" mid-window too.
RESUME_CASES: dict[str, tuple[dict[str, Any], tuple[int, int | None]]] = {
    "hybrid@1": ({}, (1, None)),
    "window@1": ({"fsdp_sync": "window"}, (1, None)),
    "micro_batch@1.2": ({"fsdp_sync": "micro_batch"}, (1, 2)),
}


def _build(mesh: Any, options: dict[str, Any], seed: int, pad: Any) -> tuple[Any, ...]:
    from _dist_scale import K, _hsdp, make_model3

    model = _hsdp(make_model3(seed), mesh)
    opt = make_optimizer(model.parameters())
    # Rank 3 resumes with an empty loader (its 7 items are used up): its padding micro-batch
    # cannot be "the last real one it saw", so it is given (the same one in every run).
    acc = fb.Accumulator(model, opt, micro_batches=K, padding_micro_batch=pad, **options)
    return model, opt, acc


def hsdp_resume(rank: int, mesh: Any) -> dict[str, Any]:
    from _dist_scale import HSDP_LAYOUT

    data = [micro_batch(rank, i, rows) for i, rows in enumerate(HSDP_LAYOUT[rank])]
    out: dict[str, Any] = {}

    def pad() -> Any:
        return data[-1]

    shared = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(shared)  # one checkpoint folder for every rank
    for name, (options, stop) in RESUME_CASES.items():
        folder = os.path.join(str(shared[0]), name)
        objs = _build(mesh, options, 0, pad)
        _loop(objs, data)
        uninterrupted = _full_params(objs[0])
        objs[2].close()

        objs = _build(mesh, options, 0, pad)
        assert _loop(objs, data, stop)
        model, opt, acc = objs
        model_state, optim_state = get_state_dict(model, opt)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder)
        acc_state = _roundtrip(acc.state_dict(), weights_only=True)
        acc.close()
        fresh = _build(mesh, options, 7, pad)  # "killed": fresh objects, another initialization
        model_state, optim_state = get_state_dict(fresh[0], fresh[1])
        dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=folder)
        set_state_dict(
            fresh[0], fresh[1], model_state_dict=model_state, optim_state_dict=optim_state
        )
        fresh[2].load_state_dict(acc_state)
        assert not _loop(fresh, data[acc_state["loader_items"] :])
        fresh[2].close()
        window = acc_state["window"]
        out[name] = {
            "uninterrupted": uninterrupted,
            "resumed": _full_params(fresh[0]),
            "loader_items": acc_state["loader_items"],
            "done": None if window is None else window["micro_batches_done"],
            "grads": [] if window is None else sorted(window["grads"]),
        }
    dist.barrier()
    if rank == 0:
        shutil.rmtree(str(shared[0]))
    return out

"""Resume checks on 2 gloo ranks, one process group (rank function :func:`resume_checks`).

FSDP2 (``fsdp_sync="micro_batch"``), AdamW, dropout, float64; the model and optimizer saved
with ``torch.distributed.checkpoint`` (the docs' recipe), the Accumulator's state per rank.
Rank 0 has 2 real micro-batches in window 1 and pads 2 (rank 1 has 4): the state is taken
after rank 0's first padding micro-batch. Then, each on fresh objects:

- ``older_window``: rank 1 loads its Accumulator state from window 0;
- ``older_point``: rank 1 loads its Accumulator state from the same window, 2 micro-batches
  earlier;
- ``optimizer_template``: rank 1 loads the model, not the optimizer (DCP's template state);
- ``model_unloaded``: rank 0 loads the optimizer, not the model (its fresh initialization);

each must raise ``ValueError`` on *every* rank (none waits for the process group's timeout)
with nothing changed; then the correct resume is bitwise the uninterrupted run on every rank,
silently. Two more: ``ddp_older_window`` (DDP: rank 1 loads an older window's state), and
``dcp_in_window`` (``get_state_dict`` inside window 0 while FSDP2 holds the window's gradients:
DCP's own optimizer step is let through, the run is bitwise the one that called it before).
"""

from __future__ import annotations

import io
import os
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

import fullbatch as fb
from _dist_cases import _full_params, rank_data, wrap
from _resume_cases import make_model

K = 4
# Per rank, the rows of its micro-batches: window 0 has 4 on both ranks; window 1 has 2 on
# rank 0 (which pads 2) and 4 on rank 1.
LAYOUT = [[2, 3, 1, 2, 3, 1], [1, 2, 3, 1, 2, 3, 2, 1]]
STOP = (1, 3)  # after rank 0's first padding micro-batch
OLDER = (1, 1)  # the same window, 2 micro-batches earlier
OLDEST = (0, 2)  # the window before
Point = tuple[int, int | None]


def _build(seed: int, wrapper: str = "fsdp", **options: Any) -> tuple[Any, ...]:
    model = wrap(make_model(seed), wrapper)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    if wrapper == "fsdp":
        options.setdefault("fsdp_sync", "micro_batch")
    return model, opt, fb.Accumulator(model, opt, micro_batches=K, **options)


def _roundtrip(state: Any) -> Any:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _train(
    objs: tuple[Any, ...],
    loader: list[Any],
    saves: dict[Point, Any] | None = None,
    stop: Point | None = None,
    dcp_dir: str = "",
) -> None:
    """Train to the end, or to ``stop``; at each point of ``saves`` keep the Accumulator's
    state there; at ``stop`` also save the model and optimizer with DCP into ``dcp_dir``."""
    model, opt, acc = objs

    def at(point: Point) -> bool:
        if saves is not None and (point in saves or point == stop):
            saves[point] = _roundtrip(acc.state_dict())
        if point == stop and dcp_dir:
            model_state, optim_state = get_state_dict(model, opt)
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=dcp_dir)
        return point == stop

    for w, window in enumerate(acc.windows(loader)):
        for j, micro in enumerate(window):
            window.backward(*fb.cross_entropy_sum(model(micro["x"]), micro["y"]))
            if at((w, j + 1)):
                return
        window.step()
        if at((w, None)):
            return


def _load(objs: tuple[Any, ...], dcp_dir: str, model: bool, optim: bool) -> None:
    """The docs' recipe: DCP's template, dcp.load into it, set_state_dict. A rank that "forgets"
    the model or the optimizer leaves it out of both (the template's tensors are the live ones:
    dcp.load alone would load them in place)."""
    m, opt, _ = objs
    model_state, optim_state = get_state_dict(m, opt)  # the optimizer's state: zeros, step 1
    wanted = {"model": model_state} if model else {}
    wanted.update({"optim": optim_state} if optim else {})
    dcp.load(wanted, checkpoint_id=dcp_dir)
    if model and optim:
        set_state_dict(m, opt, model_state_dict=model_state, optim_state_dict=optim_state)
    elif optim:
        set_optimizer_state_dict(m, opt, optim_state)
    elif model:
        set_model_state_dict(m, model_state)


def _locals(objs: tuple[Any, ...]) -> list[torch.Tensor]:
    """Every local shard of the parameters and the optimizer state, copied."""
    model, opt, _ = objs
    tensors = [p.detach() for p in model.parameters()]
    tensors += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return [(t.to_local() if hasattr(t, "to_local") else t).clone() for t in tensors]


def _refused(objs: tuple[Any, ...], loader: list[Any], name: str) -> str:
    """Resume, expecting a ValueError with nothing changed; its message."""
    before = _locals(objs)
    try:
        _train(objs, loader)
    except ValueError as error:
        after = _locals(objs)
        assert len(before) == len(after)
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        assert all(p.grad is None for p in objs[0].parameters())
        objs[2].close()
        return f"{type(error).__name__}: {error}"
    raise AssertionError(f"the resume was accepted: {name}")


def resume_checks(rank: int, world: int, tmp: str) -> dict[str, Any]:
    data = rank_data(rank, LAYOUT)
    dcp_dir = os.path.join(tmp, "dcp")
    out: dict[str, Any] = {}

    objs = _build(0)
    torch.manual_seed(100 + rank)
    _train(objs, data)
    uninterrupted = _full_params(objs[0])
    objs[2].close()

    objs = _build(0)
    torch.manual_seed(100 + rank)
    saves: dict[Point, Any] = {OLDEST: None, OLDER: None}
    _train(objs, data, saves, STOP, dcp_dir)
    objs[2].close()
    state = saves[STOP]
    out["done"] = state["window"]["micro_batches_done"]
    out["loader_items"] = start = state["loader_items"]
    resumed_loader = data[start:]

    for name, acc_state, model, optim in [
        ("older_window", saves[OLDEST] if rank == 1 else state, True, True),
        ("older_point", saves[OLDER] if rank == 1 else state, True, True),
        ("optimizer_template", state, True, rank != 1),
        ("model_unloaded", state, rank != 0, True),
    ]:
        fresh = _build(7)
        _load(fresh, dcp_dir, model, optim)
        fresh[2].load_state_dict(acc_state)
        out[name] = _refused(fresh, resumed_loader, name)

    fresh = _build(7)
    _load(fresh, dcp_dir, True, True)
    fresh[2].load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(fresh, resumed_loader)
    out["uninterrupted"], out["resumed"] = uninterrupted, _full_params(fresh[0])
    fresh[2].close()

    out["ddp_older_window"] = _ddp_older_window(rank, data)
    out["dcp_in_window"] = _dcp_in_window(data)
    return out


def _ddp_older_window(rank: int, data: list[Any]) -> str:
    objs = _build(0, "ddp")
    saves: dict[Point, Any] = {(0, 1): None}
    _train(objs, data, saves, stop=(1, 1))  # no backward of the other rank waits
    objs[2].close()
    fresh = _build(7, "ddp")
    state = saves[(0, 1)] if rank == 1 else saves[(1, 1)]
    fresh[2].load_state_dict(state)
    fresh[0].load_state_dict(objs[0].state_dict())  # the newest model and optimizer
    fresh[1].load_state_dict(objs[1].state_dict())
    return _refused(fresh, data[state["loader_items"] :], "ddp_older_window")


def _dcp_in_window(data: list[Any]) -> bool:
    """fsdp_sync="window": inside window 0 after a backward FSDP2 holds the gradients and
    ``param.grad`` is None, so DCP's get_state_dict initialises the optimizer by stepping it."""
    runs = []
    for inside in (False, True):
        objs = _build(0, fsdp_sync="window")
        model, opt, acc = objs
        if not inside:
            get_state_dict(model, opt)
        for w, window in enumerate(acc.windows(data)):
            for j, micro in enumerate(window):
                window.backward(*fb.cross_entropy_sum(model(micro["x"]), micro["y"]))
                if inside and (w, j) == (0, 0):
                    params = [p.detach().to_local().clone() for p in model.parameters()]
                    get_state_dict(model, opt)
                    moved = [p.detach().to_local() for p in model.parameters()]
                    assert all(torch.equal(a, b) for a, b in zip(params, moved, strict=True))
                    assert all(p.grad is None for p in model.parameters())
            window.step()
        acc.close()
        runs.append(_full_params(model))
    return bool(torch.equal(runs[0], runs[1]))

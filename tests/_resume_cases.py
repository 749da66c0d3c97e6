"""Rank functions for the distributed resume tests: each rank trains once uninterrupted, and
once interrupted (states saved, fresh objects built, states loaded, training resumed), and
returns both final parameters for the parent to compare."""

from __future__ import annotations

import io
from typing import Any

import torch
from torch import nn

import _dist_cases
import fullbatch as fb
from _dist_cases import IN, OUT, _full_params, rank_data, wrap


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, 16), nn.Dropout(0.3), nn.Tanh(), nn.Linear(16, OUT)).double()


def _build(spec: dict[str, Any], seed: int) -> tuple[Any, ...]:
    if spec.get("plain"):  # no dropout, SGD: comparable with the plain full-batch reference
        model = wrap(_dist_cases.make_model(seed), spec["wrapper"])
        opt = _dist_cases.make_optimizer(model.parameters())
    else:
        model = wrap(make_model(seed), spec["wrapper"])
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    acc = fb.Accumulator(model, opt, micro_batches=spec["k"], **spec.get("options", {}))
    return model, opt, acc


def _loop(objs: tuple[Any, ...], loader: list[Any], stop: Any = None) -> bool:
    """Train to the end, or stop at ``(window, micro-batches done | None)``: True if stopped."""
    model, _, acc = objs
    for w, window in enumerate(acc.windows(loader)):
        if stop == (w, 0):
            return True
        for j, micro in enumerate(window):
            window.backward(*fb.cross_entropy_sum(model(micro["x"]), micro["y"]))
            if stop == (w, j + 1):
                return True
        window.step()
        if stop == (w, None):
            return True
    return False


def _roundtrip(state: Any, weights_only: bool) -> Any:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=weights_only)


def resume_run(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    data = rank_data(rank, spec["layout"])
    objs = _build(spec, 0)
    torch.manual_seed(100 + rank)
    _loop(objs, data)
    uninterrupted = _full_params(objs[0])
    objs[2].close()

    objs = _build(spec, 0)
    torch.manual_seed(100 + rank)
    assert _loop(objs, data, tuple(spec["stop"]))
    model, opt, acc = objs
    # Each rank saves its own states; the Accumulator's loads with weights_only=True.
    states = _roundtrip([model.state_dict(), opt.state_dict()], weights_only=False)
    acc_state = _roundtrip(acc.state_dict(), weights_only=True)
    acc.close()
    fresh = _build(spec, 7)  # "killed": fresh objects, another initialization
    fresh[0].load_state_dict(states[0])
    fresh[1].load_state_dict(states[1])
    fresh[2].load_state_dict(acc_state)
    assert not _loop(fresh, data[acc_state["loader_items"] :])
    window = acc_state["window"]
    return {
        "uninterrupted": uninterrupted,
        "resumed": _full_params(fresh[0]),
        "loader_items": acc_state["loader_items"],
        "done": None if window is None else window["micro_batches_done"],
        "grads": [] if window is None else sorted(window["grads"]),
    }


def refused_world(rank: int, world: int, wrapper: str) -> str:
    """A single-process state loaded on a rank of a 2-rank job: refused, nothing changed."""
    spec = {"wrapper": wrapper, "k": 2}
    local = make_model(0)
    local_acc = fb.Accumulator(local, torch.optim.AdamW(local.parameters()), micro_batches=2)
    state = local_acc.state_dict()
    _, _, acc = _build(spec, 0)
    try:
        acc.load_state_dict(state)
    except ValueError as error:
        assert acc._engine.pending is None and acc.steps == 0
        return str(error)
    return ""


def fsdp_window_refuses(rank: int, world: int) -> str:
    spec = {"wrapper": "fsdp", "k": 2, "options": {"fsdp_sync": "window"}}
    objs = _build(spec, 0)
    assert _loop(objs, rank_data(rank, [[2, 3, 1], [3, 1, 2]]), (0, 1))
    try:
        objs[2].state_dict()
    except RuntimeError as error:
        acc = objs[2]
        fb.Window(acc._engine, acc._engine.window).discard()  # the open window
        return str(error)
    return ""

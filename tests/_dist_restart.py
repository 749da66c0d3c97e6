"""A rank killed for real and the job restarted (rank functions of
tests/distributed/test_distributed_restart.py).

The usual checkpoint scheme: every rank saves a file after every backward (model, optimizer and
its own Accumulator state; written to a temporary name, then renamed, so a kill never leaves
half a file), numbered by the backward calls it has made; a restart resumes every rank from
the highest number that every rank has.

DDP on 2 gloo ranks, ``micro_batches=4``, AdamW, dropout, float64. Window 0 has 4
micro-batches on both ranks; the tail window has 2 on rank 0 and 4 on rank 1.

- :func:`train_until_killed`: rank 1 kills itself with SIGKILL after the backward of its last
  micro-batch (its 8th), once rank 0 has saved file 6 (after its own last backward); rank 0
  then fails at its next collective. Under ``ddp_sync="last"`` rank 0's last backward
  all-reduces with rank 1's, so file 6 of rank 0 is written after rank 1's 8th backward began.
- :func:`restart`: fresh processes. The uninterrupted run first; then the resume from file 6,
  the highest both ranks have: rank 0's state after its window's last backward, rank 1's after
  its 2nd of 4 micro-batches. Under ``"last"`` that pair cannot resume (rank 1 would run the
  all-reduce of its last backward alone); it must be refused on both ranks, nothing changed,
  and the earlier pair (file 5) resumes. Under ``"step"`` no backward all-reduces: file 6
  resumes.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import fullbatch as fb
from _dist_cases import _full_params, rank_data
from _resume_cases import make_model

K = 4
LAYOUT = [[3, 1, 4, 2, 5, 2], [2, 6, 1, 3, 2, 4, 1, 2]]
KILL_AFTER = 8  # rank 1's last backward
WAIT_FOR = 6  # rank 0's file after its last backward


def _build(ddp_sync: str, seed: int) -> tuple[Any, ...]:
    model = nn.parallel.DistributedDataParallel(make_model(seed))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    return model, opt, fb.Accumulator(model, opt, micro_batches=K, ddp_sync=ddp_sync)


def _path(folder: str, rank: int, index: int) -> Path:
    return Path(folder) / f"rank{rank}-{index:03d}.pt"


def _save(folder: str, rank: int, index: int, objs: tuple[Any, ...]) -> None:
    model, opt, acc = objs
    path = _path(folder, rank, index)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "acc": acc.state_dict()}
    torch.save(state, path.with_suffix(".tmp"))
    os.replace(path.with_suffix(".tmp"), path)


def _wait_for(path: Path, seconds: float = 30.0) -> None:
    end = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > end:
            raise TimeoutError(f"{path} did not appear within {seconds} s")
        time.sleep(0.01)


def _train(
    objs: tuple[Any, ...], loader: list[Any], folder: str = "", rank: int = 0, kill: bool = False
) -> None:
    model, _, acc = objs
    index = 0
    for window in acc.windows(loader):
        for micro in window:
            window.backward(*fb.cross_entropy_sum(model(micro["x"]), micro["y"]))
            index += 1
            if kill and rank == 1 and index == KILL_AFTER:
                _wait_for(_path(folder, 0, WAIT_FOR))
                os.kill(os.getpid(), signal.SIGKILL)
            if folder:
                _save(folder, rank, index, objs)
        window.step()


def train_until_killed(rank: int, world: int, folder: str, ddp_sync: str) -> None:
    objs = _build(ddp_sync, 0)
    torch.manual_seed(100 + rank)  # dropout
    _train(objs, rank_data(rank, LAYOUT), folder, rank, kill=True)
    raise AssertionError(f"rank {rank} finished training though rank 1 was killed")


def _newest_common(folder: str, world: int) -> int:
    """The highest file number every rank has."""
    have = [
        {
            int(m.group(1))
            for p in Path(folder).iterdir()
            if (m := re.fullmatch(rf"rank{r}-(\d+)\.pt", p.name))
        }
        for r in range(world)
    ]
    return max(set.intersection(*have))


def _load(ddp_sync: str, folder: str, rank: int, index: int) -> tuple[tuple[Any, ...], int]:
    """Fresh objects (another initialization) loaded from file ``index``; its loader_items."""
    objs = _build(ddp_sync, 7)
    saved = torch.load(_path(folder, rank, index), weights_only=True)
    objs[0].load_state_dict(saved["model"])
    objs[1].load_state_dict(saved["optimizer"])
    objs[2].load_state_dict(saved["acc"])
    return objs, saved["acc"]["loader_items"]


def _other_sync(folder: str, rank: int, index: int) -> str:
    """A ``"last"`` state from inside a window loaded under ``"step"``: refused by this rank's
    load_state_dict (its gradients would be reduced twice or never)."""
    objs = _build("step", 7)
    try:
        objs[2].load_state_dict(torch.load(_path(folder, rank, index), weights_only=True)["acc"])
    except ValueError as error:
        return str(error)
    finally:
        objs[2].close()
    return ""


def _tensors(objs: tuple[Any, ...]) -> list[torch.Tensor]:
    model, opt, _ = objs
    tensors = [p.detach() for p in model.parameters()]
    return [t.clone() for t in tensors + [v for s in opt.state.values() for v in s.values()]]


def restart(rank: int, world: int, folder: str, ddp_sync: str) -> dict[str, Any]:
    data = rank_data(rank, LAYOUT)
    objs = _build(ddp_sync, 0)
    torch.manual_seed(100 + rank)
    _train(objs, data)
    out: dict[str, Any] = {"uninterrupted": _full_params(objs[0]), "refused": None}
    objs[2].close()

    index = out["index"] = _newest_common(folder, world)
    window = torch.load(_path(folder, rank, index), weights_only=True)["acc"]["window"]
    out["done"], out["final"] = window["micro_batches_done"], window["final_backward"]
    objs, start = _load(ddp_sync, folder, rank, index)
    before = _tensors(objs)
    try:
        _train(objs, data[start:])
    except ValueError as error:
        out["refused"] = f"{type(error).__name__}: {error}"
        after = _tensors(objs)
        out["unchanged"] = len(before) == len(after) and all(
            torch.equal(a, b) for a, b in zip(before, after, strict=True)
        )
        out["unchanged"] &= all(p.grad is None for p in objs[0].parameters())
        objs[2].close()
        out["other_sync"] = _other_sync(folder, rank, index)
        # The message's fix: the previous file of every rank, before rank 0's last backward.
        index = out["index"] = index - 1
        objs, start = _load(ddp_sync, folder, rank, index)
        _train(objs, data[start:])
    out["resumed"] = _full_params(objs[0])
    objs[2].close()
    return out

"""Run a function on N gloo ranks on CPU and bring every rank's result back to the parent.

No fixed ports (a FileStore in a temporary folder), a short process-group timeout, and a hard
deadline in the parent so a hang fails the test instead of stalling CI. Ranks are forked from a
forkserver that has imported torch once, so each run costs little start-up.
"""

from __future__ import annotations

import datetime
import importlib
import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_CTX = mp.get_context("forkserver")
# DDP imports torch._dynamo on construction (seconds): import it once, in the server.
_PRELOAD = ["torch", "torch._dynamo", "torch.distributed.fsdp", "torch.nn.parallel", "fullbatch"]
_CTX.set_forkserver_preload(_PRELOAD)
# What the ranks of each framework's tests import, by the top-level package a test imports.
FRAMEWORKS = {
    "transformers": ("transformers.trainer", "fullbatch.hf"),
    "trl": (
        "trl.trainer.grpo_trainer",
        "trl.trainer.sft_trainer",
        "trl.trainer.dpo_trainer",
        "fullbatch.trl",
    ),
    "datasets": ("datasets",),
}


def preload_frameworks(imported: Any) -> list[str]:
    """Have the forkserver import, once, the frameworks whose top-level package is in
    ``imported`` (the collected test modules' ``sys.modules``); return the modules it will.

    A rank of a Hugging Face or TRL test otherwise spends about 4 s of CPU importing
    ``transformers.trainer`` and TRL's trainers. Each module is imported here first: one that
    fails is left out (its tests report the error), since the server's start-up survives only
    an ``ImportError``. Call it before the first rank starts (conftest.py, after collection).
    """
    names = []
    for top, modules in FRAMEWORKS.items():
        if top not in imported:
            continue
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception:  # left to the tests that use it, which report it
                continue
            names.append(name)
    _CTX.set_forkserver_preload(_PRELOAD + names)
    return names


@dataclass
class RankResult:
    rank: int
    ok: bool
    value: Any = None
    error_type: str = ""
    error: str = ""
    exitcode: int | None = None


def _main(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    store: str,
    pg_timeout: float,
    results: Any,
    args: tuple[Any, ...],
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=pg_timeout),
    )
    try:
        value = fn(rank, world, *args)
        # Plain pickle: tensors travel as bytes, not as shared-memory handles that die with us.
        results.put(RankResult(rank, True, pickle.dumps(value)))
        results.close()
        results.join_thread()
    except BaseException as exc:  # reported to the parent, which asserts
        results.put(
            RankResult(rank, False, None, type(exc).__name__, f"{exc}\n{traceback.format_exc()}")
        )
        results.close()
        results.join_thread()  # flush before the hard exit
        os._exit(3)
    dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any], world: int, *args: Any, pg_timeout: float = 15.0, deadline: float = 90.0
) -> list[RankResult]:
    """Run ``fn(rank, world, *args)`` on ``world`` ranks; return one RankResult per rank.

    A rank that does not report within ``deadline`` seconds is killed and reported with
    ``ok=False, error_type="Timeout"``.
    """
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        results = _CTX.Queue()
        procs = [
            _CTX.Process(target=_main, args=(fn, r, world, store, pg_timeout, results, args))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        got: dict[int, RankResult] = {}
        end = datetime.datetime.now() + datetime.timedelta(seconds=deadline)
        while len(got) < world:
            left = (end - datetime.datetime.now()).total_seconds()
            if left <= 0:
                break
            try:
                res = results.get(timeout=min(left, 1.0))
                got[res.rank] = res
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
        for p in procs:
            p.join(timeout=max(0.1, (end - datetime.datetime.now()).total_seconds()))
            if p.is_alive():
                p.kill()
                p.join()
        out = []
        for r, p in enumerate(procs):
            res = got.get(r) or RankResult(
                r,
                False,
                error_type="Timeout" if p.exitcode in (None, -9) else "Died",
                error=f"exit {p.exitcode}",
            )
            res.exitcode = p.exitcode
            out.append(res)
        return out


def values(results: list[RankResult]) -> list[Any]:
    """Every rank's value, or an AssertionError showing each failed rank's error."""
    bad = [r for r in results if not r.ok]
    assert not bad, "\n".join(f"rank {r.rank}: {r.error_type}: {r.error}" for r in bad)
    return [pickle.loads(r.value) for r in results]


def several(rank: int, world: int, calls: list[tuple[Callable[..., Any], tuple[Any, ...]]]) -> Any:
    """Rank function running each ``(fn, args)`` of ``calls`` in turn, on one launch of the
    world: one process group and one start-up for checks that would each launch their own.

    Returns ``[(True, value) | (False, traceback), ...]``; :func:`one_of` hands a test its
    call's value or fails it with that call's own error, so the other calls' tests still pass.
    """
    out: list[tuple[bool, Any]] = []
    for fn, args in calls:
        try:
            out.append((True, fn(rank, world, *args)))
        except Exception as exc:  # this call's test reports it; the next call still runs
            out.append((False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    return out


def one_of(results: list[Any], index: int) -> list[Any]:
    """Every rank's value of call ``index`` of a :func:`several` launch, or an AssertionError
    with each failing rank's error of that call."""
    bad = [f"rank {r}: {res[index][1]}" for r, res in enumerate(results) if not res[index][0]]
    assert not bad, "\n".join(bad)
    return [res[index][1] for res in results]

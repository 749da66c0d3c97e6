"""Run DeepSpeed on N gloo ranks on CPU and bring every rank's result back to the parent.

The harness of every DeepSpeed test (and of the probe's DeepSpeed tests): ranks come from
:func:`_dist.run_ranks` (forked from a forkserver, a FileStore in a temporary folder: no
fixed ports; a process-group timeout; a hard deadline in the parent), and each rank sets the
environment DeepSpeed needs on a CPU machine before it imports ``deepspeed``:

- ``DS_ACCELERATOR=cpu`` (no CUDA probing), ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` (the
  Hugging Face Trainer and Accelerate read them), a dummy ``MASTER_ADDR``/``MASTER_PORT``
  (nothing listens: DeepSpeed and Accelerate find the gloo group already initialized and use
  it). ``LOCAL_SIZE`` is left unset, so DeepSpeed's shared-memory all-reduce stays off and two
  test runs never share a segment; its ``deepspeed_shm_comm`` extension is still built (by
  ninja, once) the first time a process group is wrapped, into ``TORCH_EXTENSIONS_DIR``:
  unless set, one folder per Python environment (:func:`extensions_dir`), because a build
  shared by two environments (two deepspeed versions) is rebuilt by each, and one killed
  halfway leaves a ``lock`` file on which every later run waits forever. A session that
  collected a DeepSpeed test builds it once in the background from the start
  (:func:`start_build`, from conftest.py), on the core the single-process tests leave idle, and
  :func:`run_ds` waits for that build before its ranks load it; a ``lock`` older than
  :data:`STALE_LOCK_S` is removed first, and a build the session ends halfway is killed and
  its ``lock`` removed.
- :func:`config` writes the DeepSpeed config that runs here: fp32, a torch optimizer passed
  to ``deepspeed.initialize`` (``zero_allow_untested_optimizer``; ``zero_force_ds_cpu_optimizer
  = false`` keeps ZeRO-Offload from building ``cpu_adam``, minutes of compiling),
  ``gradient_clipping`` given explicitly (0: off).

Usage, in a test module::

    import pytest
    pytest.importorskip("deepspeed")
    from _dist_ds import run_ds, values

    results = values(run_ds(my_cases.rank_fn, 2, "stage2", deadline=240))

``rank_fn(rank, world, *args)`` is a module-level function of an importable module under
``tests/`` (ranks unpickle it by name); it returns picklable values (tensors are fine), and the
parent asserts on every rank's. A rank that raises reports its traceback; a rank that hangs is
killed at ``deadline`` and reported as ``Timeout``.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from _dist import RankResult, run_ranks, values

__all__ = [
    "RankResult",
    "config",
    "extensions_dir",
    "run_ds",
    "set_env",
    "start_build",
    "trainer_config",
    "values",
]


def extensions_dir() -> str:
    """``~/.cache/torch_extensions/fullbatch-<environment>``: this interpreter's build folder."""
    key = hashlib.sha1(sys.prefix.encode()).hexdigest()[:10]
    return os.path.join(os.path.expanduser("~"), ".cache", "torch_extensions", f"fullbatch-{key}")


def set_env(rank: int, world: int) -> None:
    """The environment DeepSpeed, Accelerate and the Trainer read, set before they import."""
    os.environ.update(
        DS_ACCELERATOR="cpu",
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="1",  # never used: the gloo group exists before deepspeed.initialize
        OMP_NUM_THREADS="1",
    )
    os.environ.pop("LOCAL_SIZE", None)  # DeepSpeed's shared-memory all-reduce stays off
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", extensions_dir())


#: a ``lock`` this old is a killed build's: no build of the extension takes 15 minutes here.
STALE_LOCK_S = 900.0
# Builds the extension with DeepSpeed's own call (what every rank's first process group runs).
_BUILD_CODE = "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
_build: subprocess.Popen[bytes] | None = None


def _lock() -> str:
    """The ``lock`` torch's loader holds while it builds the extension."""
    folder = os.environ.get("TORCH_EXTENSIONS_DIR", extensions_dir())
    return os.path.join(folder, "deepspeed_shm_comm", "lock")


def start_build() -> None:
    """Build (or find built) ``deepspeed_shm_comm`` in a background process, once a session."""
    global _build
    if _build is not None:
        return
    lock = _lock()
    if os.path.exists(lock) and time.time() - os.path.getmtime(lock) > STALE_LOCK_S:
        os.remove(lock)  # a build killed halfway: torch's loader would wait on it forever
    # MAX_JOBS=1: one compiler at a time, so the build takes the core the tests leave idle
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "MAX_JOBS": "1"}
    env.setdefault("TORCH_EXTENSIONS_DIR", extensions_dir())
    started = time.time()
    _build = subprocess.Popen(
        [sys.executable, "-c", _BUILD_CODE],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own process group: ninja and the compilers end with it
    )

    def _stop() -> None:  # a session ending mid-build leaves no compiler and no lock behind
        if _build is not None and _build.poll() is None:
            os.killpg(_build.pid, signal.SIGKILL)
            _build.wait()
            if os.path.exists(lock) and os.path.getmtime(lock) >= started:
                os.remove(lock)

    atexit.register(_stop)


def _wait_for_build(deadline: float) -> None:
    """Let the background build finish before ranks load the extension (they would otherwise
    wait on its ``lock``, inside their own deadline). A failed build is the ranks' to report."""
    if _build is not None:
        try:
            _build.wait(timeout=deadline)
        except subprocess.TimeoutExpired:
            pass


def _ds_main(rank: int, world: int, fn: Callable[..., Any], *args: Any) -> Any:
    set_env(rank, world)
    import logging

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # one INFO line per call otherwise
    return fn(rank, world, *args)


def run_ds(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    pg_timeout: float = 60.0,
    deadline: float = 240.0,
) -> list[RankResult]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks with DeepSpeed's environment set.

    One :class:`_dist.RankResult` per rank; :func:`values` unpickles them or fails with every
    bad rank's error.
    """
    _wait_for_build(deadline)
    return run_ranks(_ds_main, world, fn, *args, pg_timeout=pg_timeout, deadline=deadline)


def config(
    stage: int,
    *,
    offload: bool = False,
    micro_batches: int = 4,
    micro_rows: int = 2,
    world: int = 1,
    clip: float = 0.0,
    **extra: Any,
) -> dict[str, Any]:
    """A DeepSpeed config for ZeRO ``stage`` (0-3) in fp32 that runs on this CPU machine.

    ``offload``: ``offload_optimizer`` on the CPU (stages 1-3) and, at stage 3, the
    parameters too. ``micro_batches`` is ``gradient_accumulation_steps``; ``micro_rows`` the
    nominal rows per micro-batch (DeepSpeed checks ``train_batch_size = micro_rows ·
    micro_batches · world``; the engine takes any rows in its forward).
    """
    zero: dict[str, Any] = {"stage": stage}
    if offload:
        if stage == 0:
            raise ValueError("ZeRO stage 0 has no offload")
        zero["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    out: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_rows,
        "gradient_accumulation_steps": micro_batches,
        "train_batch_size": micro_rows * micro_batches * world,
        "gradient_clipping": clip,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    out.update(extra)
    return out


def trainer_config(stage: int, *, offload: bool = False, clip: Any = "auto") -> dict[str, Any]:
    """:func:`config` for the Hugging Face Trainer / Accelerate: batch sizes ``"auto"`` (filled
    from ``TrainingArguments``), ``gradient_clipping`` = ``clip`` (``"auto"``: the Trainer's
    ``max_grad_norm``; ``None`` leaves the key out, which DeepSpeed then fills with 1.0)."""
    out = config(stage, offload=offload)
    out.update(
        train_micro_batch_size_per_gpu="auto",
        gradient_accumulation_steps="auto",
        train_batch_size="auto",
        gradient_clipping=clip,
    )
    if clip is None:
        del out["gradient_clipping"]
    return out

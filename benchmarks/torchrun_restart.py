"""A rank killed mid-window and restarted by torchrun: does the restart come up, and is the
resumed run the uninterrupted one? With and without ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``.

    python benchmarks/torchrun_restart.py [--runs 10] [--nproc 2]

Each run launches ``python -m torch.distributed.run --standalone --nproc-per-node N
--max-restarts 1`` on this script as a worker (gloo, CPU). The worker trains a small FSDP2
model (``fsdp_sync="micro_batch"``, AdamW, dropout, float64, 3 windows of 3 micro-batches per
rank) with the docs' recipe (docs/checkpointing.md): inside window 1, after its second
micro-batch, every rank saves the model and optimizer with ``torch.distributed.checkpoint``
and its own Accumulator state; then the last rank kills itself with SIGKILL. torchrun stops
the other ranks and starts them all again (``TORCHELASTIC_RESTART_COUNT=1``); they load the
checkpoint and finish. Per setting, one row: launches whose restart came up (every rank
finished training after it), exact ones (rank 0's final parameters bitwise those of an
uninterrupted run: one launch without the kill, first), those where torchrun exited 0, those
where a rank aborted at interpreter exit after finishing ("terminate called without an active
exception", a gloo teardown bug: torchrun then reports a failure though the training is done),
those that hung (killed after 120 s), the median time per launch, and the first error of a
launch whose restart did not come up. Each rank frees the model, optimizer and Accumulator
(and collects garbage) before ``destroy_process_group()``, as the docs do; ``--no-cleanup``
destroys the process group while they still hold it, and shows the abort at exit.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

K, WINDOWS, KILL_AT = 3, 3, (1, 2)  # micro-batches per window, windows, where the kill comes
TIMEOUT = 120  # seconds per launch (one that restarts takes about 25 s on 2 busy cores)


# -- the worker (one rank, launched by torchrun) -----------------------------------------------


def _worker(folder: Path, kill: bool, cleanup: bool) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    import fullbatch as fb

    dist.init_process_group("gloo")
    rank, attempt = dist.get_rank(), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.Dropout(0.2), nn.Tanh(), nn.Linear(32, 4))
    model = model.double()
    for layer in (model[0], model[3]):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    acc = fb.Accumulator(model, opt, micro_batches=K, fsdp_sync="micro_batch")
    g = torch.Generator().manual_seed(10 + rank)
    data = [
        {"x": torch.randn(4, 6, generator=g, dtype=torch.float64), "y": torch.arange(4) % 4}
        for _ in range(K * WINDOWS)
    ]
    ckpt = folder / "checkpoint"
    start = 0
    torch.manual_seed(100 + rank)  # dropout
    if (ckpt / "complete").exists():  # a restart: the docs' recipe
        model_state, optim_state = get_state_dict(model, opt)
        dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=str(ckpt))
        set_state_dict(model, opt, model_state_dict=model_state, optim_state_dict=optim_state)
        state = torch.load(ckpt / f"acc-rank{rank}.pt", weights_only=True)
        acc.load_state_dict(state)
        start = state["loader_items"]
        print(f"rank {rank} attempt {attempt}: resumed from item {start}", flush=True)
    for w, window in enumerate(acc.windows(data[start:])):
        for j, micro in enumerate(window):
            window.backward(*fb.cross_entropy_sum(model(micro["x"]), micro["y"]))
            if kill and attempt == 0 and (w, j + 1) == KILL_AT:
                model_state, optim_state = get_state_dict(model, opt)
                dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(ckpt))
                torch.save(acc.state_dict(), ckpt / f"acc-rank{rank}.pt")
                dist.barrier()
                if rank == 0:
                    (ckpt / "complete").touch()
                dist.barrier()
                if rank == dist.get_world_size() - 1:
                    os.kill(os.getpid(), signal.SIGKILL)
        window.step()
    flat = torch.cat([p.detach().full_tensor().reshape(-1) for p in model.parameters()])
    print(f"rank {rank} attempt {attempt}: trained, {acc.steps} steps", flush=True)
    if rank == 0:
        buf = io.BytesIO()
        torch.save({"params": flat, "attempt": attempt, "steps": acc.steps}, buf)
        (folder / "final.pt").write_bytes(buf.getvalue())
    world = dist.get_world_size()
    if cleanup:  # docs/checkpointing.md: free what holds the process group, then destroy it
        del model, opt, acc, window, micro
        gc.collect()
    dist.destroy_process_group()
    (folder / f"done-{rank}-of-{world}-attempt-{attempt}").touch()
    print(f"rank {rank} attempt {attempt}: done", flush=True)


# -- the launcher ------------------------------------------------------------------------------


def _launch(
    folder: Path, nproc: int, kill: bool, share_store: bool, cleanup: bool = True
) -> tuple[int, float, str]:
    env = dict(os.environ)
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    if not share_store:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        "1",
        __file__,
        "--worker",
        str(folder),
        *(["--kill"] if kill else []),
        *([] if cleanup else ["--no-cleanup"]),
    ]
    begin = time.perf_counter()
    log = folder / "torchrun.log"
    with log.open("w") as out:  # a file, not a pipe: a hung worker cannot block the reading
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            # Killing torchrun alone would leave its workers running: kill each one, by pid.
            for pid in [*_descendants(proc.pid), proc.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait()
            return -1, time.perf_counter() - begin, f"hung: killed after {TIMEOUT} s"
    stderr = log.read_text()
    # In the first attempt the killed rank's peer fails ("Connection closed/reset by peer"), as
    # expected; what matters is what failed after it (the restarted ranks' errors come last).
    expected = ("Connection closed by peer", "Connection reset by peer", "ChildFailedError")
    lines = [
        line.strip()
        for line in stderr.splitlines()
        if "Error:" in line and not any(e in line for e in expected)
    ]
    return proc.returncode, time.perf_counter() - begin, (lines[-1] if lines else "")[:240]


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc), deepest first."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    return _descendants_of(pid, parents)


def _descendants_of(pid: int, parents: dict[int, list[int]]) -> list[int]:
    out: list[int] = []
    for child in parents.get(pid, []):
        out += [*_descendants_of(child, parents), child]
    return out


def _final(folder: Path) -> Any:
    path = folder / "final.pt"
    return torch.load(path, weights_only=True) if path.exists() else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--worker", type=Path)
    parser.add_argument("--kill", action="store_true")
    parser.add_argument(
        "--no-cleanup",
        action="store_true",
        help="destroy the process group while FSDP2's model and optimizer still hold it",
    )
    parser.add_argument(
        "--setting",
        choices=["both", "shared", "disabled"],
        default="both",
        help="run only torchrun's default (shared store), or only with the variable set to 1",
    )
    parser.add_argument("--logs", type=Path, help="keep the torchrun log of each failed launch")
    args = parser.parse_args()
    if args.worker is not None:
        _worker(args.worker, args.kill, not args.no_cleanup)
        return
    with tempfile.TemporaryDirectory() as tmp:
        reference_dir = Path(tmp, "reference")
        reference_dir.mkdir()
        code, _, error = _launch(reference_dir, args.nproc, kill=False, share_store=False)
        reference = _final(reference_dir)
        assert code == 0 and reference is not None, f"the uninterrupted run failed: {error}"
        print(f"torch {torch.__version__}, {args.nproc} gloo ranks, {args.runs} runs per setting")
        print(
            f"{'TORCH_DISABLE_SHARE_RDZV_TCP_STORE':<34} {'restarted':>9} {'exact':>5} "
            f"{'exit 0':>6} {'abort@exit':>10} {'hung':>4} {'s/launch':>8}  first error"
        )
        settings = {"both": (True, False), "shared": (True,), "disabled": (False,)}
        for share_store in settings[args.setting]:
            row = _measure(Path(tmp), args, share_store, reference["params"])
            print(row)


def _measure(tmp: Path, args: Any, share_store: bool, reference: torch.Tensor) -> str:
    """``args.runs`` launches with one setting, as one row of the table."""
    up = exact = exit0 = aborted = hung = 0
    times, errors = [], []
    name = "shared" if share_store else "disabled"
    for i in range(args.runs):
        folder = tmp / f"{name}-{i}"
        (folder / "checkpoint").mkdir(parents=True)
        code, seconds, error = _launch(folder, args.nproc, True, share_store, not args.no_cleanup)
        times.append(seconds)
        final = _final(folder)
        done = [folder / f"done-{r}-of-{args.nproc}-attempt-1" for r in range(args.nproc)]
        restarted = all(d.exists() for d in done)  # every rank finished after the restart
        up += restarted
        exact += restarted and final is not None and torch.equal(final["params"], reference)
        exit0 += code == 0
        hung += code == -1
        log = (folder / "torchrun.log").read_text()
        aborted += "terminate called without an active exception" in log
        if not restarted and code != -1:
            errors.append(f"exit {code}: {error}")
        if code != 0 and args.logs is not None:
            args.logs.mkdir(parents=True, exist_ok=True)
            (args.logs / f"{name}-{i}.log").write_text(log)
    setting = "unset (shared store)" if share_store else "1"
    first = errors[0] if errors else ""
    return (
        f"{setting:<34} {f'{up}/{args.runs}':>9} {exact:>5} {exit0:>6} {aborted:>10} {hung:>4} "
        f"{statistics.median(times):>8.1f}  {first}"
    )


if __name__ == "__main__":
    main()

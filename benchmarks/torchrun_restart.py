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
checkpoint and finish. A run counts as restarted when torchrun exits 0 after the restart;
as exact when rank 0's final parameters are bitwise those of an uninterrupted run (one
launch without the kill, first). A launch that has not finished after 120 s is killed and
counted as hung. Prints one row per setting: restarts that came up, exact results, launches
that hung, the median time per launch, and the first error of a launch that failed otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
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


def _worker(folder: Path, kill: bool) -> None:
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
    if rank == 0:
        buf = io.BytesIO()
        torch.save({"params": flat, "attempt": attempt, "steps": acc.steps}, buf)
        (folder / "final.pt").write_bytes(buf.getvalue())
    dist.destroy_process_group()


# -- the launcher ------------------------------------------------------------------------------


def _launch(folder: Path, nproc: int, kill: bool, share_store: bool) -> tuple[int, float, str]:
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
    args = parser.parse_args()
    if args.worker is not None:
        _worker(args.worker, args.kill)
        return
    with tempfile.TemporaryDirectory() as tmp:
        reference_dir = Path(tmp, "reference")
        reference_dir.mkdir()
        code, _, error = _launch(reference_dir, args.nproc, kill=False, share_store=False)
        reference = _final(reference_dir)
        assert code == 0 and reference is not None, f"the uninterrupted run failed: {error}"
        print(f"torch {torch.__version__}, {args.nproc} gloo ranks, {args.runs} runs per setting")
        print(
            f"{'TORCH_DISABLE_SHARE_RDZV_TCP_STORE':<36} {'restarted':>10} {'exact':>6} "
            f"{'hung':>5} {'s/launch':>9}  first error"
        )
        for share_store in (True, False):
            up = exact = hung = 0
            times, errors = [], []
            for i in range(args.runs):
                folder = Path(tmp, f"{share_store}-{i}")
                (folder / "checkpoint").mkdir(parents=True)
                code, seconds, error = _launch(folder, args.nproc, True, share_store)
                times.append(seconds)
                final = _final(folder)
                restarted = code == 0 and final is not None and final["attempt"] == 1
                up += restarted
                exact += restarted and torch.equal(final["params"], reference["params"])
                hung += code == -1
                if not restarted and code != -1:
                    errors.append(f"exit {code}: {error}")
            setting = "unset (shared store)" if share_store else "1"
            first = errors[0] if errors else ""
            print(
                f"{setting:<36} {f'{up}/{args.runs}':>10} {exact:>6} {hung:>5} "
                f"{statistics.median(times):>9.1f}  {first}"
            )


if __name__ == "__main__":
    main()

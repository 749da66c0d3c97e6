"""``fullbatch probe`` under ``torchrun`` (2 gloo ranks, a DDP script): one report, printed by
rank 0, and the same exit status on every rank (0 right, 1 wrong).

torchrun runs ``fullbatch probe`` on each rank through a two-line launcher that records the
rank's exit status in a file (torchrun itself reports only whether any rank failed). No fixed
port: ``--standalone`` rendezvous on a free one. Bounded by the subprocess timeout.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_SRC = str(Path(__file__).parents[2] / "src")

SCRIPT = """
import contextlib
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Linear(4, 3))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(rank)
sizes = [(1, 3, 2, 5), (2, 2, 4, 1)][rank]  # 11 + 9 rows per window over the two ranks
loader = [(torch.randn(n, 4, generator=g), torch.randint(3, (n,), generator=g)) for n in sizes]
for i, (x, y) in enumerate(loader * 3):
    last = (i + 1) % 4 == 0
    with contextlib.nullcontext() if last else model.no_sync():
        logits = model(x)
        if sys.argv[1] == "wrong":  # each micro-batch's mean over the 4 micro-batches
            loss = F.cross_entropy(logits, y) / 4
        else:  # the window's sum over its 20 rows (DDP averages the ranks: times world)
            loss = F.cross_entropy(logits, y, reduction="sum") * world / 20
        loss.backward()
    if last:
        opt.step()
        opt.zero_grad()
print(f"rank {rank} finished", flush=True)
"""

LAUNCHER = """
import os, sys
from fullbatch.cli import main

status = main(sys.argv[1:])
with open(os.path.join(os.environ["STATUS_DIR"], "rank" + os.environ["RANK"]), "w") as f:
    f.write(str(status))
sys.exit(status)
"""


def _torchrun(folder: Path, mode: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": _SRC, "STATUS_DIR": str(folder), "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "launch.py", "probe", "--objective", "sample", "--", "python", "train.py", mode,
    ]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, cwd=folder, env=env, timeout=300)


@pytest.mark.parametrize(
    ("mode", "status", "verdict"), [("right", 0, "RIGHT"), ("wrong", 1, "WRONG")]
)
def test_one_report_and_one_exit_status_on_every_rank(
    tmp_path: Path, mode: str, status: int, verdict: str
) -> None:
    (tmp_path / "train.py").write_text(textwrap.dedent(SCRIPT))
    (tmp_path / "launch.py").write_text(textwrap.dedent(LAUNCHER))
    result = _torchrun(tmp_path, mode)
    output = result.stdout + result.stderr
    statuses = {
        r: (tmp_path / f"rank{r}").read_text() for r in (0, 1) if (tmp_path / f"rank{r}").exists()
    }
    assert statuses == {0: str(status), 1: str(status)}, output
    # torchrun's own code: a rank's status, unless Gloo aborted that rank's interpreter
    # teardown after its status was written (a torch issue: pytorch/pytorch#179291; the probe
    # frees the group first, docs/probe.md says to gate on --json): only that abort is let by.
    teardown = "terminate called without an active exception" in output
    assert (result.returncode == 0) == (status == 0) or (teardown and status == 0), output
    assert output.count("fullbatch probe:") == 1, output  # rank 0 alone prints the report
    assert f"fullbatch probe: {verdict} (" in result.stdout, output
    assert "windows 1-2 checked" in result.stdout
    assert "on 2 ranks" in result.stdout  # both ranks' micro-batches make each window
    assert "finished" not in output  # stopped after the probed windows, on both ranks

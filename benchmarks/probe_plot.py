"""The picture of docs/probe.md: ``fullbatch probe --plot`` on a script that accumulates
per-micro-batch means over uneven micro-batches (a mean of per-micro-batch means).

    PYTHONPATH=src python benchmarks/probe_plot.py docs/probe_plot.png

writes the picture (and, beside it in a temporary folder, the ``--json`` report it prints the
first line of). The script: a float32 classifier, windows of 4 micro-batches of 1, 3, 2 and 6
rows, each micro-batch's mean loss divided by 4; the probe checks the first two windows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

SCRIPT = """
import torch
import torch.nn.functional as F

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 5))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(1)
loader = [(torch.randn(n, 8, generator=g), torch.randint(5, (n,), generator=g))
          for n in (1, 3, 2, 6)] * 3
for step, (x, y) in enumerate(loader):
    loss = F.cross_entropy(model(x), y) / 4  # each micro-batch's own mean, over 4
    loss.backward()
    if (step + 1) % 4 == 0:
        optimizer.step()
        optimizer.zero_grad()
"""


def main(out: str) -> int:
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "train.py").write_text(textwrap.dedent(SCRIPT))
        report = Path(folder) / "probe.json"
        command = [
            sys.executable, "-m", "fullbatch", "probe", "--objective", "sample",
            "--json", str(report), "--plot", os.path.abspath(out), "--", "python", "train.py",
        ]  # fmt: skip
        result = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True)
        print(result.stdout.splitlines()[0] if result.stdout else result.stderr)
        data = json.loads(report.read_text())
        print(f"exit status {result.returncode}; json verdict {data['verdict']!r}; wrote {out}")
        return 0 if result.returncode == 1 and data["verdict"] == "wrong" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "docs/probe_plot.png"))

"""A tiny training script for the ``fullbatch probe`` command's tests, and how to run it.

``train.py MODE``: 3 windows of 4 micro-batches (11 rows each), an SGD step per window, the loss
the window's sum over its rows (right) unless ``MODE`` says otherwise; it prints ``stepped N``
after each step and ``script finished`` at its end. ``obj.py`` holds a right objective
(``loss``) and one that raises (``broken``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SRC = str(Path(__file__).parents[2] / "src")

SCRIPT = """
import sys
import torch
import torch.nn.functional as F

mode = sys.argv[1]
torch.manual_seed(0)
model = torch.nn.Linear(4, 3)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = [{"x": torch.randn(n, 4), "labels": torch.randint(3, (n,))} for n in (1, 3, 2, 5)] * 3
for i, batch in enumerate(data):
    logits = model(batch["x"])
    print("forward", i + 1, flush=True)
    (F.cross_entropy(logits, batch["labels"], reduction="sum") / 11).backward()
    if (i + 1) % 4 == 0:
        opt.step()
        opt.zero_grad()
        print("stepped", (i + 1) // 4, flush=True)
    if mode == "raises-in-window-2" and i == 5:
        raise KeyError("a bug in window 2")
    if mode.startswith("exits-") and i == 9:
        sys.exit(int(mode.removeprefix("exits-")))
print("script finished", flush=True)
"""

OBJECTIVES = """
import fullbatch as fb

def loss(model, batch):
    return fb.cross_entropy_sum(model(batch["x"]), batch["labels"])

def broken(model, batch):
    raise RuntimeError("the objective's own bug")
"""


def write_scripts(folder: Path) -> Path:
    (folder / "train.py").write_text(textwrap.dedent(SCRIPT))
    (folder / "obj.py").write_text(textwrap.dedent(OBJECTIVES))
    return folder


def probe(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m fullbatch probe ARGS`` in ``folder``."""
    return subprocess.run(
        [sys.executable, "-m", "fullbatch", "probe", *args],
        capture_output=True, text=True, cwd=folder, timeout=240,
        env={**os.environ, "PYTHONPATH": SRC},
    )  # fmt: skip

"""What every script of this folder shares: its float64 truth, printed as one line.

A script trains as users write it, remembers its model before the first step and the first
window's update, and at its end (after the probe, if any, has removed its hooks) prints
``TRUTH {"error": ...}``: the update's relative distance from the float64 full-batch update
the script asked for. ``benchmarks/probe_round3.py`` reads that line from a plain run.
"""

from __future__ import annotations

import json
from typing import Any

import torch


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten().double() for p in model.parameters()])


def say(error: float | None, **more: Any) -> None:
    print("TRUTH " + json.dumps({"error": error, **more}), flush=True)


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())

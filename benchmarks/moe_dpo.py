"""TRL's DPO on a tiny MoE model with its router aux loss: one step against the float64 full batch.

Tiny random Mixtral, Qwen3-MoE and OLMoE (``tests/_trl_dpo_moe_cases.py``: float64, 2 layers,
4 experts, top-2, ``router_aux_loss_coef`` 0.25, the character tokenizer's 100 ids), 7
preference pairs of uneven lengths as one window of 4 micro-batches (2, 2, 2 and 1 pairs,
each padded its own way), one process, one thread. The reference is written in that module:
one forward of the window's 14 sequences, the sigmoid DPO loss over its 7 pairs plus ``coef``
times transformers' pooled load-balancing loss of that forward (in float64). Each row is one
SGD step of a trainer: its error ``‖Δθ - Δθ*‖ / ‖Δθ*‖``. ``DPOTrainer, 1 micro-batch`` is
TRL's own full batch: its distance to the reference is the float32 inside TRL's fused LM head
and the models' float32 casts. ``aux term alone`` rows weight the DPO term by zero
(``loss_weights=[0.0]``). ``per-micro-batch aux`` is the written-out step with each
micro-batch's own load-balancing loss (weighted by its pairs), the DPO term exact. The last
column is the routing pre-pass's time over the whole step's (``train_runtime``), this CPU.

Run: ``PYTHONPATH=src python benchmarks/moe_dpo.py`` (about a minute of CPU time).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _trl_cases import windows
from _trl_dpo_moe_cases import per_micro_step, reference, run, step_error

FAMILIES = ("mixtral", "qwen3_moe", "olmoe")
N, K, BATCH = 7, 4, 2


def _row(family: str, label: str, got: dict[str, Any], k: int, weight: float) -> str:
    before = got["steps"][0]
    want = reference(family, windows(got["seen"], k)[0], before, weight=weight)
    error = step_error(got["steps"][1], want["after"], before)
    share = sum(p["seconds"] for p in got["prepasses"]) / got["seconds"]
    cost = f"{share:.2f}" if got["prepasses"] else "-"
    return f"| {family} | {label} | {error:.1e} | {cost} |"


def main() -> None:
    torch.set_num_threads(1)
    print("| model | trainer | step error | pre-pass / step time |")
    print("|---|---|---|---|")
    for family in FAMILIES:
        full = run(family, N, k=1, batch=N, exact=False)
        print(_row(family, "DPOTrainer, 1 micro-batch (TRL's full batch)", full, 1, 1.0))
        print(
            _row(
                family, "DPOTrainer (stock)", run(family, N, k=K, batch=BATCH, exact=False), K, 1.0
            )
        )
        exact = run(family, N, k=K, batch=BATCH)
        print(_row(family, "ExactDPOTrainer", exact, K, 1.0))
        before = exact["steps"][0]
        want = reference(family, windows(exact["seen"], K)[0], before)
        per_micro = per_micro_step(family, exact["seen"], before)
        print(f"| {family} | per-micro-batch aux (written out) | "
              f"{step_error(per_micro, want['after'], before):.1e} | - |")  # fmt: skip
        alone = {"loss_weights": [0.0]}
        stock = run(family, N, k=K, batch=BATCH, exact=False, **alone)
        print(_row(family, "DPOTrainer (stock), aux term alone", stock, K, 0.0))
        exact = run(family, N, k=K, batch=BATCH, **alone)
        print(_row(family, "ExactDPOTrainer, aux term alone", exact, K, 0.0))


if __name__ == "__main__":
    main()

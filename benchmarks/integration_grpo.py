"""Stock ``trl.GRPOTrainer`` against ``fullbatch.trl.ExactGRPOTrainer``: per-window error.

Work (tests/_grpo_cases.py, shared with the tests so that both measure the same objective):
a tiny random Qwen2 policy in float64 on CPU, a tokenizer built in code, 12 prompts x 4
generations, completions of at most 6 tokens sampled on CPU, a reward in code, SGD lr=0.05,
no clipping, 4 per-device sequences per micro-batch, 4 optimizer steps. For every optimizer
step the gradient the optimizer received is compared with the loss type's objective over
exactly that step's sequences (computed in one plain pass at the step's parameters):
relative L2 error per window. TRL computes log-probabilities in float32 chunks, so about 2e-7
is the agreement floor of an exact step.

Settings: ``steps_per_generation`` 4 with ``gradient_accumulation_steps`` 2 (a generation
batch cut into two windows) and 2 with 4 (a window spanning two generation batches); loss
types ``grpo`` (plain, and with an entropy bonus ``entropy_coef=0.05``), ``dapo``, ``cispo``
(``epsilon_high=1.1``) and ``dr_grpo`` with the entropy bonus.

Run: ``python benchmarks/integration_grpo.py`` (about a minute on 2 CPU cores).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from trl import GRPOTrainer

import _grpo_cases as cases
from fullbatch.trl import ExactGRPOTrainer

RUNS = [
    ("grpo", {}),
    ("grpo", {"entropy_coef": 0.05}),
    ("dapo", {}),
    ("cispo", {"epsilon_high": 1.1}),
    ("dr_grpo", {"entropy_coef": 0.05}),
]
SETTINGS = [(4, 2), (2, 4)]


def errors(cls: type, loss_type: str, spg: int, ga: int, extra: dict) -> list[float]:
    trainer = cases.run(
        cls,
        loss_type=loss_type,
        steps_per_generation=spg,
        gradient_accumulation_steps=ga,
        max_steps=4,
        **extra,
    )
    return cases.step_errors(cases.settings(trainer), trainer._recorder.steps)


def main() -> None:
    print("relative L2 error of each window's gradient against the window's objective")
    print(f"{'loss_type':<24} {'spg':>3} {'GA':>3}  {'trainer':<17} per-window errors (4 steps)")
    for loss_type, extra in RUNS:
        label = loss_type + (" + entropy bonus" if "entropy_coef" in extra else "")
        for spg, ga in SETTINGS:
            for name, cls in (("GRPOTrainer", GRPOTrainer), ("ExactGRPOTrainer", ExactGRPOTrainer)):
                errs = " ".join(f"{e:.1e}" for e in errors(cls, loss_type, spg, ga, extra))
                print(f"{label:<24} {spg:>3} {ga:>3}  {name:<17} {errs}")


if __name__ == "__main__":
    main()

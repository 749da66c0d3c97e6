"""TRL's GRPO on a tiny MoE model with its router aux loss: one step against the float64 full batch.

Tiny random Mixtral, Qwen3-MoE, OLMoE (2 layers each) and Qwen2-MoE (1 layer, a shared
expert), float64, 4 experts, top-2, ``router_aux_loss_coef`` 0.1 (``tests/_grpo_cases.py``),
loss type ``dapo``, one process, one thread. One generation batch of 16 sampled completions
(4 prompts x 4 generations, at most 6 tokens, uneven lengths) is one window: 4 micro-batches
of 4 sequences (``gradient_accumulation_steps`` = ``steps_per_generation`` = 4), or 1 of 16
(TRL's own full batch). The reference is written in that module: the policy objective over
the step's sequences plus ``coef`` times the load-balancing loss of all of them pooled, in
float64. Each row is one SGD step (no clipping): its gradient's error ``‖g - g*‖ / ‖g*‖``
against the reference on the sequences that trainer trained on. TRL's fused LM head computes
log-probabilities in float32, so its own full batch is about 1e-7 off. ``aux term alone``
rows give every completion one reward: the advantages are 0, the policy term's gradient is
exactly 0, and only the aux term remains. ``per-micro-batch aux (written out)`` is the
reference with each micro-batch's own load-balancing loss averaged (TRL's form) in place of
the window's, on the exact trainer's sequences. The last two columns are the routing
pre-pass's time (``trainer.fb_stats_seconds``) over the whole step's (``train_runtime``,
generation and rewards included), and over the window's training forwards and backwards
(``training_step``, with TRL's default gradient checkpointing), this CPU.

Run: ``PYTHONPATH=src python benchmarks/moe_grpo.py`` (about a minute on 2 CPU cores).
"""

from __future__ import annotations

import contextlib
import io
import sys
import time
from pathlib import Path
from typing import Any

import torch
from trl import GRPOTrainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import _grpo_cases as cases
from fullbatch.trl import ExactGRPOTrainer

FAMILIES = ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe")
K, ROWS = 4, 4  # micro-batches per window, sequences per micro-batch
STEPS = 4  # optimizer steps (windows) per run


def _timed(trainer_cls: type) -> type:
    """``trainer_cls`` summing its ``training_step`` time (the window's forwards and backwards)."""

    class Timed(trainer_cls):  # type: ignore[misc, valid-type]
        fb_train_seconds = 0.0

        def training_step(self, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return super().training_step(*args, **kwargs)
            finally:
                self.fb_train_seconds += time.perf_counter() - start

    return Timed


def train(family: str, trainer_cls: type, k: int, *, constant: bool = False) -> Any:
    """``STEPS`` optimizer steps, each a window of ``k`` micro-batches of 16 sequences."""
    rows = ROWS * K // k
    extra: dict[str, Any] = {"rewards": lambda completions, **kw: [1.0] * len(completions)}
    with contextlib.redirect_stdout(io.StringIO()):  # the Trainer's printed logs
        return cases.run(
            _timed(trainer_cls),
            moe=family,
            loss_type="dapo",
            per_device_train_batch_size=rows,
            steps_per_generation=k,
            gradient_accumulation_steps=k,
            router_aux_loss_coef=0.1,
            max_steps=STEPS,
            **(extra if constant else {}),
        )


def _windowed(trainer: Any) -> dict[str, Any]:
    """The float64 full batch's settings: the load-balancing loss of the whole window."""
    return {**cases.settings(trainer), "router_window": True}


def _rel(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    num = sum(((got[k] - want[k]) ** 2).sum() for k in want)
    return float((num / sum((w**2).sum() for w in want.values())).sqrt())


def _row(family: str, label: str, trainer: Any) -> str:
    steps = trainer._recorder.steps
    assert [len(s["micro"]) for s in steps] == [trainer.args.gradient_accumulation_steps] * STEPS
    error = max(cases.step_errors(_windowed(trainer), steps))
    share = "- | -"  # the stock trainer runs no pre-pass
    if isinstance(trainer, ExactGRPOTrainer):
        pre = trainer.fb_stats_seconds
        assert pre > 0, "the routing pre-pass was not timed"
        runtime = trainer.state.log_history[-1]["train_runtime"]
        share = f"{pre / runtime:.2f} | {pre / trainer.fb_train_seconds:.2f}"
    return f"| {family} | {label} | {error:.1e} | {share} |"


def _per_micro(family: str, trainer: Any) -> str:
    """TRL's per-micro-batch aux form, the policy term exact, against the window's."""
    errors = []
    for step in trainer._recorder.steps:
        want = cases.reference(_windowed(trainer), step)[0]
        got = cases.reference({**_windowed(trainer), "router_window": False}, step)[0]
        errors.append(_rel(got, want))
    return f"| {family} | per-micro-batch aux (written out) | {max(errors):.1e} | - | - |"


def main() -> None:
    torch.set_num_threads(1)
    print("| model | trainer | step error | pre-pass / step time | pre-pass / fwd+bwd time |")
    print("|---|---|---|---|---|")
    for family in FAMILIES:
        full = train(family, GRPOTrainer, 1)
        print(_row(family, "GRPOTrainer, 1 micro-batch (TRL's full batch)", full))
        print(_row(family, "GRPOTrainer (stock)", train(family, GRPOTrainer, K)))
        exact = train(family, ExactGRPOTrainer, K)
        print(_row(family, "ExactGRPOTrainer", exact))
        print(_per_micro(family, exact))
        alone = "aux term alone"
        stock = train(family, GRPOTrainer, K, constant=True)
        print(_row(family, f"GRPOTrainer (stock), {alone}", stock))
        exact = train(family, ExactGRPOTrainer, K, constant=True)
        print(_row(family, f"ExactGRPOTrainer, {alone}", exact))


if __name__ == "__main__":
    main()

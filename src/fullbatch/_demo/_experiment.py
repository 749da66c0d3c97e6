"""The experiment: every arm trained in lockstep on the same batches, measured at every step.

At each step, before anyone updates, a *shadow* copy of the model is loaded with the full-batch
arm's weights and every recipe computes its gradient there. Comparing gradients at the same
weights isolates the recipe's arithmetic from the drift that training adds on top.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from fullbatch._demo._arms import Arm, Batch, make_arm, param_distance, relative_error

__all__ = ["ARM_ORDER", "Record", "make_optimizer_factory", "run_arms"]

# Arms in the order they appear in tables, the CSV and legends.
ARM_ORDER = ("full_batch", "permuted_rows", "naive", "fullbatch")

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class Record:
    """One arm at one step (one row of ``metrics.csv``).

    Attributes:
        step: optimizer step, from 1.
        arm: ``full_batch``, ``permuted_rows``, ``naive`` or ``fullbatch``.
        micro_batch_size: rows per micro-batch (the batch size for the full-batch arms).
        true_loss: token-mean loss over the batch at this arm's weights before the step.
        reported_loss: the loss this recipe logs (naive: the mean of micro-batch means).
        shadow_grad_error: ``‖g − g_full‖ / ‖g_full‖``, with ``g`` this recipe's gradient at the
            full-batch arm's weights (0 for the full-batch arm itself).
        param_distance: ``‖θ − θ_full‖ / ‖θ_full‖`` after the step.
    """

    step: int
    arm: str
    micro_batch_size: int
    true_loss: float
    reported_loss: float
    shadow_grad_error: float
    param_distance: float


def make_optimizer_factory(name: str, lr: float) -> OptimizerFactory:
    """AdamW or plain SGD (no optimizer state) with learning rate ``lr``.

    Raises:
        ValueError: ``name`` is neither ``adamw`` nor ``sgd``.
    """
    if name == "adamw":
        return lambda params: torch.optim.AdamW(params, lr=lr)
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=lr)
    raise ValueError(f"unknown optimizer {name!r}; choose 'adamw' or 'sgd'")


def _non_identity_permutation(rows: int, generator: torch.Generator) -> torch.Tensor:
    # An identity draw would make the "permuted" arm a bit-exact copy of the full-batch arm.
    while True:
        perm = torch.randperm(rows, generator=generator)
        if rows < 2 or not torch.equal(perm, torch.arange(rows)):
            return perm


def run_arms(
    initial: torch.nn.Module,
    batches: Sequence[Batch],
    *,
    micro_batch_sizes: Sequence[int],
    optimizer_factory: OptimizerFactory,
    seed: int,
) -> Iterator[list[Record]]:
    """Train every arm from ``initial``'s weights; yield the step's records after each step.

    Arms: the full batch, the full batch with its rows in a random order (two exact runs that
    differ only by rounding), and naive accumulation and fullbatch at each micro-batch size.
    """
    batch_size = batches[0]["input_ids"].shape[0]
    arms: list[Arm] = [
        make_arm("full_batch", batch_size, initial, optimizer_factory),
        make_arm("permuted_rows", batch_size, initial, optimizer_factory),
    ]
    for name in ("naive", "fullbatch"):
        arms += [make_arm(name, m, initial, optimizer_factory) for m in micro_batch_sizes]
    full = arms[0]
    shadow = copy.deepcopy(initial)
    generator = torch.Generator().manual_seed(seed)
    try:
        for step, batch in enumerate(batches, start=1):
            perm = _non_identity_permutation(batch_size, generator).to(batch["labels"].device)
            inputs = {arm.name: batch for arm in arms}
            inputs["permuted_rows"] = {k: v[perm] for k, v in batch.items()}
            with torch.no_grad():
                for mirror, weight in zip(
                    shadow.parameters(), full.model.parameters(), strict=True
                ):
                    mirror.copy_(weight)
            reference = full.gradient_at(shadow, batch)
            errors = [
                0.0
                if arm is full
                else relative_error(arm.gradient_at(shadow, inputs[arm.name]), reference)
                for arm in arms
            ]
            losses = [arm.train(inputs[arm.name]) for arm in arms]
            yield [
                Record(
                    step=step,
                    arm=arm.name,
                    micro_batch_size=arm.micro_batch_size,
                    true_loss=loss.true,
                    reported_loss=loss.reported,
                    shadow_grad_error=error,
                    param_distance=param_distance(arm.model, full.model),
                )
                for arm, loss, error in zip(arms, losses, errors, strict=True)
            ]
    finally:
        for arm in arms:
            arm.close()

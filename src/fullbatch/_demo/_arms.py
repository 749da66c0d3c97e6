"""The training recipes the demo compares, and how it measures the gradient each one computes.

A recipe does one optimizer step on one batch with whatever optimizer it is given. Handing it
a :class:`GradientRecorder` instead of AdamW captures the gradient the recipe would have
applied, without changing the weights: that is how the demo evaluates every recipe at the
full-batch arm's parameters (its *shadow gradient*).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

import fullbatch as fb
from fullbatch._base._split import split_rows
from fullbatch._verify._recorder import GradientRecorder

__all__ = [
    "Arm",
    "Batch",
    "GradientRecorder",
    "Losses",
    "full_batch_step",
    "fullbatch_step",
    "make_arm",
    "naive_step",
    "param_distance",
    "relative_error",
]

Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Losses:
    """The batch's loss at the parameters before the step.

    Attributes:
        true: token mean over the whole batch, ``Σ loss sums / Σ tokens``.
        reported: what the recipe itself would log.
    """

    true: float
    reported: float


def _loss_sum(model: torch.nn.Module, micro: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"]).logits
    return fb.causal_lm_loss(logits, micro["labels"])


def full_batch_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Batch
) -> Losses:
    """The reference: the whole batch in one forward and backward, loss averaged over tokens."""
    loss_sum, n = _loss_sum(model, batch)
    loss = loss_sum / n
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    value = loss.item()
    return Losses(true=value, reported=value)


def naive_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, micro_batch_size: int
) -> Losses:
    """Naive accumulation: each micro-batch's *mean* loss divided by the number of micro-batches.

    This is the recipe TRL and transformers shipped until October 2024. It weights a token of a
    short micro-batch more than a token of a long one, so the gradient depends on how the batch
    was cut, unless every micro-batch holds the same number of tokens.
    """
    micros = split_rows(batch, micro_batch_size)
    sums, counts, means = [], [], []
    for micro in micros:
        loss_sum, n = _loss_sum(model, micro)
        mean = loss_sum / n
        (mean / len(micros)).backward()
        sums.append(loss_sum.detach())
        counts.append(n)
        means.append(mean.detach())
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    true = (torch.stack(sums).sum() / torch.stack(counts).sum()).item()
    return Losses(true=true, reported=torch.stack(means).mean().item())


def fullbatch_step(acc: fb.Accumulator, model: torch.nn.Module, batch: Batch) -> Losses:
    """fullbatch: summed losses and token counts; the Accumulator normalizes and steps."""
    sums, counts = [], []
    for window in acc.windows([batch]):  # one loader item: one window
        for micro in window:
            loss_sum, n = _loss_sum(model, micro)
            window.backward(loss_sum, n)
            sums.append(loss_sum.detach())
            counts.append(n)
        stats = window.step()
        true = (torch.stack(sums).sum() / torch.stack(counts).sum()).item()
        return Losses(true=true, reported=stats.loss)
    raise AssertionError("unreachable: a one-item loader yields one window")


@dataclass
class Arm:
    """One training run: a recipe with its own copy of the model and its own optimizer.

    Attributes:
        name: ``full_batch``, ``permuted_rows``, ``naive`` or ``fullbatch``.
        micro_batch_size: rows per micro-batch (the batch size for the full-batch arms).
        model: this arm's weights.
        optimizer: this arm's optimizer.
    """

    name: str
    micro_batch_size: int
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    _acc: fb.Accumulator | None = field(default=None, repr=False)

    def train(self, batch: Batch) -> Losses:
        """One optimizer step of this arm's recipe on ``batch``."""
        if self.name == "fullbatch":
            if self._acc is None:
                self._acc = fb.Accumulator(
                    self.model, self.optimizer, micro_batch_size=self.micro_batch_size
                )
            return fullbatch_step(self._acc, self.model, batch)
        return self._run(self.model, self.optimizer, batch)

    def gradient_at(self, shadow: torch.nn.Module, batch: Batch) -> list[torch.Tensor]:
        """The gradient this arm's recipe computes on ``batch`` at ``shadow``'s weights."""
        recorder = GradientRecorder(shadow.parameters())
        if self.name == "fullbatch":
            acc = fb.Accumulator(shadow, recorder, micro_batch_size=self.micro_batch_size)
            try:
                fullbatch_step(acc, shadow, batch)
            finally:
                acc.close()
        else:
            self._run(shadow, recorder, batch)
        return [
            torch.zeros_like(p) if g is None else g
            for p, g in zip(shadow.parameters(), recorder.recorded or [], strict=True)
        ]

    def _run(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Batch
    ) -> Losses:
        if self.name == "naive":
            return naive_step(model, optimizer, batch, self.micro_batch_size)
        return full_batch_step(model, optimizer, batch)

    def close(self) -> None:
        """Release the Accumulator (hooks, sync flags), if this arm has one."""
        if self._acc is not None:
            self._acc.close()
            self._acc = None


def make_arm(
    name: str,
    micro_batch_size: int,
    initial: torch.nn.Module,
    optimizer_factory: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer],
) -> Arm:
    """A new arm starting from a copy of ``initial``'s weights."""
    model = copy.deepcopy(initial)
    return Arm(name, micro_batch_size, model, optimizer_factory(model.parameters()))


@torch.no_grad()
def relative_error(grads: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """``‖g − g_ref‖ / ‖g_ref‖`` over all parameters together, computed in float64."""
    diff = sum(
        float((g.double() - r.double()).square().sum())
        for g, r in zip(grads, reference, strict=True)
    )
    ref = sum(float(r.double().square().sum()) for r in reference)
    return (diff / ref) ** 0.5 if ref > 0 else float("nan")


@torch.no_grad()
def param_distance(model: torch.nn.Module, reference: torch.nn.Module) -> float:
    """``‖θ − θ_ref‖ / ‖θ_ref‖`` over all parameters together, computed in float64."""
    return relative_error(list(model.parameters()), list(reference.parameters()))

"""The micro-batch step shared by the fullbatch TRL trainers."""

from __future__ import annotations

from typing import Any

import torch

from fullbatch.hf import ExactTrainer


def offloaded_training_step(
    self: Any, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
) -> torch.Tensor:
    """ExactTrainer's micro-batch, inside TRL's activation-offloading context."""
    with self.maybe_activation_offload_context:
        return ExactTrainer.training_step(self, model, inputs, num_items_in_batch)

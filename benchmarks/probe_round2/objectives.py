"""Objectives declared to the probe (--objective objectives.py:NAME)."""

import torch
import torch.nn.functional as F

WEIGHTS = torch.tensor([0.1, 0.5, 4.0, 0.2, 1.0, 1.0, 2.0])


def weighted(model, micro):
    """The class-weighted cross-entropy: its sum, and the weights' sum as its count."""
    labels = micro["labels"]
    loss_sum = F.cross_entropy(model(micro["x"]), labels, weight=WEIGHTS, reduction="sum")
    return loss_sum, WEIGHTS[labels].sum()

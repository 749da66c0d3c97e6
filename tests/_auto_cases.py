"""Toy models that raise ``torch.OutOfMemoryError`` above a size, for the "auto" tests."""

from __future__ import annotations

import torch
from torch import nn


class TokenLM(nn.Module):
    """A causal toy LM that runs out of memory above ``tokens`` padded tokens per forward."""

    def __init__(self, tokens: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(17, 8)
        self.out = nn.Linear(8, 17)
        self.tokens = tokens

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.numel() > self.tokens:
            raise torch.OutOfMemoryError(f"{ids.numel()} tokens do not fit ({self.tokens})")
        return self.out(torch.tanh(self.embed(ids)))

"""The RNG state a re-run or a resumed run must find: CPU, and CUDA once initialized."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["RngState"]


class RngState:
    """The RNG states at construction; :meth:`restore` puts them back.

    >>> saved = RngState()
    >>> a = torch.rand(2)
    >>> saved.restore()
    >>> torch.equal(a, torch.rand(2))
    True
    """

    def __init__(self) -> None:
        self.cpu = torch.get_rng_state()
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        self.cuda = torch.cuda.get_rng_state_all() if cuda else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)

    def to_dict(self) -> dict[str, Any]:
        """Tensors only (``torch.load(weights_only=True)`` reads them)."""
        return {"cpu": self.cpu} if self.cuda is None else {"cpu": self.cpu, "cuda": self.cuda}

    @staticmethod
    def restore_dict(state: dict[str, Any]) -> None:
        """Restore states saved by :meth:`to_dict`."""
        torch.set_rng_state(state["cpu"])
        if "cuda" in state:
            torch.cuda.set_rng_state_all(state["cuda"])

"""Exact TRL trainers: subclasses of TRL's trainers whose every optimizer step is the full-batch
objective over that step's rows, pairs or sequences. A user changes one import.

>>> import fullbatch.trl
>>> fullbatch.trl.ExactGRPOTrainer.__mro__[1].__name__
'GRPOTrainer'
"""

from __future__ import annotations

try:
    import trl  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without trl
    raise ImportError("fullbatch.trl needs TRL: pip install 'fullbatch[trl]'") from exc

from fullbatch.trl._grpo import ExactGRPOTrainer

__all__ = ["ExactGRPOTrainer"]

"""Exact gradient accumulation for TRL's trainers: change one import.

``fullbatch.trl.ExactSFTTrainer`` is a ``trl.SFTTrainer`` (and ``ExactDPOTrainer`` a
``trl.DPOTrainer``) with exactly its constructor arguments whose every optimizer step equals
the full-batch step over that step's rows, whatever the model's head does with
``num_items_in_batch``. TRL options that cannot be made exact are refused at construction, with
the reason. See ``docs/integrations_trl.md``.

>>> import fullbatch.trl
>>> fullbatch.trl.ExactSFTTrainer.__mro__[2].__name__
'SFTTrainer'
"""

from __future__ import annotations

try:
    import trl as _trl  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without trl
    raise ImportError(
        "fullbatch.trl needs TRL (and transformers): pip install 'fullbatch[trl]'"
    ) from exc

from fullbatch.trl._dpo import ExactDPOTrainer
from fullbatch.trl._sft import ExactSFTTrainer

__all__ = ["ExactDPOTrainer", "ExactSFTTrainer"]

"""Exact TRL trainers: subclasses of TRL's trainers whose every optimizer step is the full-batch
objective over that step's rows, pairs or sequences. A user changes one import.

``fullbatch.trl.ExactSFTTrainer`` is a ``trl.SFTTrainer``, ``ExactDPOTrainer`` a
``trl.DPOTrainer`` and ``ExactGRPOTrainer`` a ``trl.GRPOTrainer``, each with exactly its
constructor arguments, whatever the model's head does with ``num_items_in_batch``. TRL options
that cannot be made exact are refused at construction, with the reason. See
``docs/integrations_trl.md`` and ``docs/integrations_grpo.md``.

>>> import fullbatch.trl
>>> fullbatch.trl.ExactSFTTrainer.__mro__[2].__name__
'SFTTrainer'
>>> fullbatch.trl.ExactGRPOTrainer.__mro__[1].__name__
'GRPOTrainer'
"""

from __future__ import annotations

try:
    import trl as _trl  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without trl
    raise ImportError(
        "fullbatch.trl needs TRL (and transformers): pip install 'fullbatch[trl]'"
    ) from exc

from fullbatch.trl._dpo import ExactDPOTrainer
from fullbatch.trl._grpo import ExactGRPOTrainer
from fullbatch.trl._sft import ExactSFTTrainer

__all__ = ["ExactDPOTrainer", "ExactGRPOTrainer", "ExactSFTTrainer"]

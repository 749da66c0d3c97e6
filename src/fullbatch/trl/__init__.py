"""Exact TRL trainers: subclasses of TRL's trainers whose every optimizer step is the full-batch
objective over that step's rows, pairs or sequences. A user changes one import.

``fullbatch.trl.ExactSFTTrainer`` is a ``trl.SFTTrainer``, ``ExactDPOTrainer`` a
``trl.DPOTrainer`` and ``ExactGRPOTrainer`` a ``trl.GRPOTrainer``, each with exactly its
constructor arguments, whatever the model's head does with ``num_items_in_batch``. TRL options
that cannot be made exact are refused at construction, with the reason. See
``docs/integrations_trl.md`` and ``docs/integrations_grpo.md``.

Modules: ``_sft``, ``_dpo``, ``_grpo`` (the trainers), ``_step`` (their shared micro-batch
step), ``_grpo_window`` (a GRPO window's numbers), ``_grpo_moe`` (a GRPO window's MoE
load-balancing term), ``_refuse`` and ``_grpo_config`` (settings refused up front),
``_objective`` (a stock TRL trainer's objective per micro-batch, for ``fb.probe``).

>>> import fullbatch.trl
>>> fullbatch.trl.ExactSFTTrainer.__mro__[2].__name__
'SFTTrainer'
>>> fullbatch.trl.ExactGRPOTrainer.__mro__[1].__name__
'GRPOTrainer'
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

try:
    import trl as _trl  # noqa: F401  (cheap: TRL's own __init__ is lazy)
except ImportError as exc:  # pragma: no cover - exercised only without trl
    raise ImportError(
        "fullbatch.trl needs TRL (and transformers): pip install 'fullbatch[trl]'"
    ) from exc

if TYPE_CHECKING:
    from fullbatch.trl._dpo import ExactDPOTrainer
    from fullbatch.trl._grpo import ExactGRPOTrainer
    from fullbatch.trl._sft import ExactSFTTrainer

__all__ = ["ExactDPOTrainer", "ExactGRPOTrainer", "ExactSFTTrainer"]

# Each trainer is imported on first use (PEP 562): ``from fullbatch.trl import ExactSFTTrainer``
# imports TRL's SFT trainer only, not its DPO and GRPO trainers.
_LAZY = {
    "ExactDPOTrainer": "fullbatch.trl._dpo",
    "ExactGRPOTrainer": "fullbatch.trl._grpo",
    "ExactSFTTrainer": "fullbatch.trl._sft",
}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'fullbatch.trl' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

"""fullbatch: gradient accumulation that trains exactly like the full batch.

Start with :class:`Accumulator`; prove equivalence on your own model with :func:`verify`;
check any other training code's accumulation with :func:`probe`.

>>> import fullbatch as fb
>>> fb.Accumulator.__name__, fb.Window.__name__, fb.StepStats.__name__
('Accumulator', 'Window', 'StepStats')

The public names are imported on first use (PEP 562), so ``import fullbatch`` and
``fullbatch --help`` do not import torch.

Private packages, floor by floor: ``_base`` (the leaves), ``_proof`` (the shared objective and
tolerance), ``_engine`` (``fb.Accumulator``), ``_wings`` (the framework wings' floor),
``_pipeline`` (``fb.Pipeline``), ``_verify`` (``fb.verify``), ``_probe`` (``fb.probe``) and
``_demo`` (``fullbatch demo``). Public modules: ``hf``, ``trl``, ``lightning``, ``deepspeed``,
``super_gradients``, ``composer``, ``testing``, ``cli``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fullbatch import moe, testing
    from fullbatch._base._losses import causal_lm_loss, count_tokens, cross_entropy_sum
    from fullbatch._base._lr import scale_lr
    from fullbatch._base._rows import row_windows
    from fullbatch._base._stats import StepStats
    from fullbatch._engine._accumulator import Accumulator
    from fullbatch._engine._window import Window
    from fullbatch._pipeline import Pipeline, PipelineLoss
    from fullbatch._probe import probe
    from fullbatch._verify import VerifyReport, verify

__version__ = "0.1.0"

__all__ = [
    "Accumulator",
    "Pipeline",
    "PipelineLoss",
    "StepStats",
    "VerifyReport",
    "Window",
    "__version__",
    "causal_lm_loss",
    "count_tokens",
    "cross_entropy_sum",
    "moe",
    "probe",
    "row_windows",
    "scale_lr",
    "testing",
    "verify",
]

# public name -> the private module that defines it (a module itself when the name is "")
_LAZY = {
    "Accumulator": "fullbatch._engine._accumulator",
    "Pipeline": "fullbatch._pipeline",
    "PipelineLoss": "fullbatch._pipeline",
    "StepStats": "fullbatch._base._stats",
    "VerifyReport": "fullbatch._verify",
    "Window": "fullbatch._engine._window",
    "causal_lm_loss": "fullbatch._base._losses",
    "count_tokens": "fullbatch._base._losses",
    "cross_entropy_sum": "fullbatch._base._losses",
    "moe": "fullbatch.moe",
    "probe": "fullbatch._probe",
    "row_windows": "fullbatch._base._rows",
    "scale_lr": "fullbatch._base._lr",
    "testing": "fullbatch.testing",
    "verify": "fullbatch._verify",
}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'fullbatch' has no attribute {name!r}")
    module = importlib.import_module(module_name)
    value = module if name in ("moe", "testing") else getattr(module, name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

"""fullbatch: gradient accumulation that trains exactly like the full batch.

Start with :class:`Accumulator`; prove equivalence on your own model with :func:`verify`.

>>> import fullbatch as fb
>>> fb.Accumulator.__name__, fb.Window.__name__, fb.StepStats.__name__
('Accumulator', 'Window', 'StepStats')
"""

from fullbatch import testing
from fullbatch._accumulator import Accumulator
from fullbatch._losses import causal_lm_loss, count_tokens, cross_entropy_sum
from fullbatch._lr import scale_lr
from fullbatch._stats import StepStats
from fullbatch._verify import verify
from fullbatch._verify_report import VerifyReport
from fullbatch._window import Window

__version__ = "0.1.0"

__all__ = [
    "Accumulator",
    "StepStats",
    "VerifyReport",
    "Window",
    "__version__",
    "causal_lm_loss",
    "count_tokens",
    "cross_entropy_sum",
    "scale_lr",
    "testing",
    "verify",
]

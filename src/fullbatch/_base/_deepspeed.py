"""How fullbatch recognises a DeepSpeed engine, for every floor (the probe, the wings).

Read from ``sys.modules``: nothing is imported, and an engine exists only where its user
imported DeepSpeed.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["is_deepspeed_engine"]


def is_deepspeed_engine(obj: Any) -> bool:
    """Whether ``obj`` is a ``DeepSpeedEngine``.

    >>> is_deepspeed_engine(object())
    False
    """
    engine = sys.modules.get("deepspeed.runtime.engine")
    cls = getattr(engine, "DeepSpeedEngine", None)
    return cls is not None and isinstance(obj, cls)

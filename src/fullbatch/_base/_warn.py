"""Warnings that point at the user's line, however deep in fullbatch they are raised.

A hard-coded ``stacklevel`` is right for one call path only: ``window.step()`` in a plain
loop, ``window.run(fn)`` and ``window.run_coupled`` reach the same warning through different
depths. :func:`warn` counts the frames instead: the first frame outside the ``fullbatch``
package is the user's. A wing whose framework calls it (a Trainer callback, a Lightning hook)
names the framework's packages in ``through``: their frames are walked past too, so the
warning points at the user's ``trainer.train()``, not at the framework's loop.
"""

from __future__ import annotations

import sys
import warnings

__all__ = ["user_stacklevel", "warn"]


def user_stacklevel(skip: int = 1, through: tuple[str, ...] = ()) -> int:
    """The ``stacklevel`` of the first frame outside fullbatch, seen from ``skip`` frames up.

    ``skip=1``: from the function that calls ``user_stacklevel`` (the one that warns).
    ``through``: top-level packages (e.g. ``("transformers", "accelerate")``) whose frames
    are walked past as if they were fullbatch's.

    >>> user_stacklevel() >= 1
    True
    """
    frame = sys._getframe(skip)
    level = 1
    while frame.f_back is not None and _ours(frame, through):
        frame = frame.f_back
        level += 1
    return level


def _ours(frame: object, through: tuple[str, ...]) -> bool:
    name = str(getattr(frame, "f_globals", {}).get("__name__", ""))
    return name.partition(".")[0] in ("fullbatch", *through)


def warn(
    message: str, category: type[Warning] = UserWarning, *, through: tuple[str, ...] = ()
) -> None:
    """``warnings.warn(message, category)`` attributed to the user's line.

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     warn("careful", RuntimeWarning)
    >>> caught[0].category.__name__, str(caught[0].message)
    ('RuntimeWarning', 'careful')
    """
    warnings.warn(message, category, stacklevel=user_stacklevel(2, through) + 1)

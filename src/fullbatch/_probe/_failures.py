"""What kept the probe from checking, in the report's words, each naming its window as the
report numbers windows: 1 for the first ``step()`` seen inside the block, counted as the
probe saw them (:attr:`fullbatch._probe._report.WindowCheck.step`).

fullbatch's own engine numbers its windows from 0 (``acc.windows``: "window 0 was
skipped", "the loss passed to window.backward in window 0 ..."); where such a message ends
the run, the report's failure line says which of its own windows the run was in and that the
message counts from 0, so the two numbers are never read as one.
"""

from __future__ import annotations

import re

__all__ = ["gave_up", "padded", "run_failed", "unsupported"]

_NAMES_A_WINDOW = re.compile(r"\bwindow (\d+)\b")


def gave_up(error: BaseException, window: int, keep_going: bool) -> str:
    """The problem line of a probe whose own check failed in ``window``.

    >>> gave_up(ValueError("no labels\\nmore"), 2, True)  # doctest: +ELLIPSIS
    'not checked from window 2 on: the probe failed (ValueError: no labels); the run went on...'
    """
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return (
        f"not checked from window {max(window, 1)} on: the probe failed "
        f"({type(error).__name__}: {first}); "
        + ("the run went on without it" if keep_going else "the run was stopped")
    )


def padded(route: str, count: int) -> str:
    """The problem line of a window in which ``route`` ran ``count`` padding micro-batches.

    >>> padded("fb.Accumulator", 1)  # doctest: +ELLIPSIS
    'unsupported: fb.Accumulator ran 1 zero-weight padding micro-batch(es) in this window...'
    """
    return (
        f"unsupported: {route} ran {count} zero-weight padding micro-batch(es) in this window "
        "(its ranks hold different numbers of micro-batches, and FSDP2 or an empty rank needs "
        "as many forwards on each), which the probe cannot yet tell from micro-batches; probe "
        "windows in which every rank holds as many micro-batches"
    )


def run_failed(text: str, where: str) -> str:
    """The failure line of a run that ended with an error ``where`` (``"in window 2"``, ``"after
    window 1's step"``, ``"after the probed windows"``); where ``text`` names another window
    (fullbatch's own messages count from 0), the line says how the two count.

    >>> run_failed("the script raised KeyError: 'a bug in window 2'", "in window 2")
    "the script raised KeyError: 'a bug in window 2' (in window 2)"
    >>> print(run_failed("RuntimeError: step() on window 0, ...", "after window 1's step"))
    ... # doctest: +NORMALIZE_WHITESPACE
    RuntimeError: step() on window 0, ... (after window 1's step; this report counts windows
    from 1, fullbatch's own messages from 0)
    """
    named = set(_NAMES_A_WINDOW.findall(text))
    if named and named != set(_NAMES_A_WINDOW.findall(where)):
        where += "; this report counts windows from 1, fullbatch's own messages from 0"
    return f"{text} ({where})"


def unsupported(why: str) -> str:
    """The problem line of a window no gradient reader can read."""
    return (
        f"unsupported: {why}; the probe reads the gradient the optimizer applies "
        "through one reader per engine (.grad: plain loops, DDP, the Hugging Face "
        "Trainer, TRL, Lightning, Accelerate; DeepSpeed ZeRO 0-3 with or without "
        "offload; FSDP2 and HSDP; tensor parallelism, alone or under FSDP2/HSDP)"
    )

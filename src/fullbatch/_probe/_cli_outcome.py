"""What a ``fullbatch probe`` run ends with: its exit status, and the probe's own failure or
the script's in the command line's words (``--objective``, never ``objective=``).

torch is imported only where a report exists (after the run), so ``--help`` stays fast.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from fullbatch._probe._cli_args import FAILED, RIGHT, UNCHECKED, USAGE, WRONG

__all__ = ["exit_status", "fail", "rank", "script_failure", "usage_text"]


def rank() -> int:
    """This process's rank: the default process group's when the script set one up, else
    torchrun's ``RANK`` (0 outside torchrun); torch is not imported for it."""
    if "torch" in sys.modules:
        from fullbatch._base._sync._probe import default_rank

        found = default_rank()
        if found is not None:
            return found
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def fail(message: str) -> int:
    """Say ``message`` as the command's error (rank 0); the usage status."""
    if rank() == 0:
        print(f"fullbatch probe: error: {message}", file=sys.stderr)
    return USAGE


def exit_status(report: Any, script_status: int | None, *, probe_failed: bool = False) -> int:
    """``fullbatch probe``'s exit status from its report, the script's own exit status (None:
    it did not fail: it ended, or the probe stopped it) and whether the probe's own check
    failed (the declared objective could not be inferred or computed).

    First that holds: a window judged wrong, 1; the probe failed, 2; no window judged (no
    step, no micro-batch, an unsupported engine, the script failed before a window ended), 3;
    the script failed after right windows, 4 (never its own status: a script's 1 or 3 would
    read as WRONG or nothing checked); a window left unchecked, 3; else 0.

    >>> from fullbatch._probe._report import ProbeReport, WindowCheck
    >>> def window(ok, pattern):
    ...     return WindowCheck(1, ok, 0.0, 0.0, 0.0, 1, 1.0, (1.0,), 0.0, "", pattern, "", "")
    >>> right, wrong = window(True, "right"), window(False, "dropped")
    >>> [exit_status(ProbeReport((right,)), None), exit_status(ProbeReport((wrong,)), 4),
    ...  exit_status(ProbeReport(()), 1), exit_status(ProbeReport((right,)), 3),
    ...  exit_status(ProbeReport((right,)), None, probe_failed=True)]
    [0, 1, 3, 4, 2]
    """
    from fullbatch._probe._report import UNCHECKED as unchecked

    judged = [w for w in report.windows if w.pattern not in unchecked]
    if any(not w.ok for w in judged):
        return WRONG
    if probe_failed:
        return USAGE
    if not judged:
        return UNCHECKED
    if script_status not in (None, 0):
        return FAILED
    if not report.ok:
        return UNCHECKED
    return RIGHT


def usage_text(error: BaseException) -> str:
    """The probe's own failure in the command line's words.

    >>> from fullbatch._probe._trainer_objective import Unknown
    >>> said = usage_text(Unknown("KTOTrainer", "it trains a loss of its own"))
    >>> said[:90]
    'no --objective given, and cannot infer the objective for KTOTrainer: it trains a loss of i'
    >>> "declare it: --objective FILE.py:FN" in said and "objective=" not in said
    True
    """
    from fullbatch._probe._run import ObjectiveUnknown
    from fullbatch._probe._trainer_objective import Unknown

    text = str(error).strip()
    stopped = "(stopped at the model's first forward, before any step)"
    if isinstance(error, Unknown):
        return (
            f"no --objective given, and cannot infer the objective for {error.trainer}: "
            f"{error.why}; declare it: --objective FILE.py:FN, a function fn(model, micro) -> "
            "(loss_sum, count) that sums the loss over the micro-batch's items (docs/probe.md, "
            "'What a callable objective receives'), or --objective causal_lm, token or sample "
            f"where one fits {stopped}"
        )
    if isinstance(error, ObjectiveUnknown):
        why = text.split(": ", 1)[-1].split("; pass", 1)[0]
        return (
            f"no --objective given, and {why}; pass --objective causal_lm, token, sample or "
            f"FILE.py:FN {stopped}"
        )
    hint = " (here: --objective causal_lm, token, sample or FILE.py:FN)"
    return text.rstrip(".") + (hint if "objective=" in text else "")


def script_failure(status: int | None, error: BaseException | None) -> str:
    """How the script failed, for the report."""
    if error is not None:
        return (
            f"the script raised {type(error).__name__}: {error} (exit status 1 without the probe)"
        )
    return f"the script exited with status {status}"

"""``fb.probe`` and ``fullbatch probe``: check any training code's accumulation, unchanged.

One job per module:

- ``_run``: :func:`probe` and its context manager (hooks in, windows checked, hooks out);
- ``_capture``: forward hooks that record each micro-batch (inputs, RNG and autocast state);
- ``_where``: the call stack: the engine's micro-batch around a forward, the engine stepping;
- ``_objective``: the declared objective's ``(loss_sum, count)`` per micro-batch;
- ``_recompute``: replay a window's micro-batches with ``torch.autograd.grad`` (no ``.grad``,
  RNG, buffer or reducer touched); the rounding band;
- ``_sample``: the gradient coordinates the weight fit looks at; ``_norms``: squared norms
  and distances of gradient lists, a chunk at a time;
- ``_check``: one window at ``step()``: sums over ranks, comparison, tolerance;
- ``_fit``, ``_diagnose``, ``_fixes``: each micro-batch's weight, the pattern, the fix;
- ``_clip``: ``clip_grad_norm_`` observed while probing;
- ``_report``: :class:`ProbeReport`, :class:`WindowCheck`;
- ``_cli``: the ``fullbatch probe`` command.

The package imports nothing heavy itself, so ``fullbatch --help`` can load ``_cli`` without
torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fullbatch._probe._run import probe

__all__ = ["probe"]


def __getattr__(name: str) -> Any:
    if name == "probe":
        from fullbatch._probe._run import probe

        return probe
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Replay one recorded call under the declared objective and differentiate it, touching nothing.

The call's RNG state is restored before the forward (dropout draws the same masks) and its
autocast regions re-entered; :func:`grads_of` differentiates with ``torch.autograd.grad``,
which hands the gradients back instead of accumulating them into ``.grad`` and runs no hook on
the parameters' gradient accumulators (DDP's reducer hooks live there). :func:`reversed_call`
is the same call with its rows in reverse order (the same math with other rounding) where that
changes no dropout mask.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from fullbatch._base._modelstate import _DROPOUT_ATTRIBUTES
from fullbatch._probe._call_loss import ObjectiveFn
from fullbatch._probe._capture import Call
from fullbatch._proof._reorder import reverse_rows

__all__ = [
    "Grads", "dropout_active", "grads_of", "replay", "replaying", "reversed_call", "rows_of",
]  # fmt: skip

Grads = list[torch.Tensor | None]


@contextlib.contextmanager
def replaying(call: Call) -> Iterator[None]:
    """Run inside as ``call`` ran: its RNG state restored, its autocast regions re-entered."""
    call.rng.restore()
    regions = dict(call.autocast)
    with contextlib.ExitStack() as stack:
        devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
        for device in devices:
            if device in regions:
                stack.enter_context(torch.autocast(device, dtype=regions[device]))
            elif torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


def dropout_active(module: nn.Module) -> bool:
    for m in module.modules():
        if not m.training:
            continue
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            return True
        if any(isinstance(v := getattr(m, a, None), float) and v > 0 for a in _DROPOUT_ATTRIBUTES):
            return True
    return False


def rows_of(values: list[Any]) -> int | None:
    """The common first dimension of every tensor in ``values`` (nested one level), or None."""
    sizes = set()
    for value in values:
        inner = (
            value.values()
            if isinstance(value, dict)
            else (value if isinstance(value, (list, tuple)) else [value])
        )
        for t in inner:
            if isinstance(t, torch.Tensor) and t.dim() > 0:
                sizes.add(t.shape[0])
    return sizes.pop() if len(sizes) == 1 else None


def reversed_call(call: Call) -> Call | None:
    """The call with its rows in reverse order, when that is the same math with other rounding."""
    parts = [*call.args, call.kwargs, call.micro, call.targets]
    rows = rows_of(parts)
    if rows is None or rows < 2 or dropout_active(call.module):
        return None
    return Call(
        module=call.module,
        wrapper=call.wrapper,
        args=reverse_rows(call.args, rows),
        kwargs=reverse_rows(call.kwargs, rows),
        rng=call.rng,
        autocast=call.autocast,
        micro=reverse_rows(call.micro, rows),
        targets=reverse_rows(call.targets, rows),
    )


def grads_of(loss: torch.Tensor, params: list[nn.Parameter], *, retain: bool = False) -> Grads:
    """``∂loss/∂p`` for each of ``params`` (None where unused), no ``.grad`` written;
    ``retain``: keep the graph (another backward, the engine's own, goes through it)."""
    if not loss.requires_grad:
        return [None] * len(params)
    try:
        grads: Grads = list(
            torch.autograd.grad(loss, params, allow_unused=True, retain_graph=retain)
        )
    except RuntimeError as error:
        if "heckpoint" in str(error):
            raise _reentrant() from error
        raise
    if params and all(g is None for g in grads) and _reentrant_in(loss):
        raise _reentrant()  # its parameters are not in the graph autograd.grad sees
    return grads


def _reentrant() -> RuntimeError:
    return RuntimeError(
        "the model uses reentrant activation checkpointing, which the probe's "
        "torch.autograd.grad cannot differentiate through; use non-reentrant "
        "checkpointing (gradient_checkpointing_kwargs={'use_reentrant': False}, or "
        "torch.utils.checkpoint(..., use_reentrant=False))."
    )


def _reentrant_in(loss: torch.Tensor) -> bool:
    """Whether ``loss``'s graph holds a reentrant checkpoint (``CheckpointFunctionBackward``)."""
    seen, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if "CheckpointFunction" in type(node).__name__:
            return True
        stack.extend(n for n, _ in node.next_functions)
    return False


def replay(
    call: Call, objective: ObjectiveFn, params: list[nn.Parameter], scale: float
) -> tuple[Grads, float]:
    """The gradients of ``scale · loss_sum`` of one call under ``objective``, and its count."""
    with replaying(call):
        loss, count = objective(call.module, call)
    return grads_of(loss * scale if scale != 1.0 else loss, params), count

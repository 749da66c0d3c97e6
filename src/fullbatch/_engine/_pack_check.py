"""The packing check of ``window.run(fn)`` with ``pack=True``: before the first packed window
changes anything, its first micro-batch holding two rows or more is run packed and padded
through ``fn`` (see :mod:`fullbatch._base._packcheck`). A failure abandons the window and
raises ``ValueError`` with the cause; parameters, gradients, optimizer state and the RNG are
untouched. Cost: about one window, once. Opt out with ``Accumulator(..., verify_pack=False)``.

Under DDP the check runs on each rank without a collective (no gradient sync, no buffer
broadcast); under FSDP2 it cannot run on sharded parameters and says so once.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from fullbatch._base._modelstate import ModelSnapshot, disable_dropout
from fullbatch._base._packcheck import PackingReport, check_packed, repack
from fullbatch._base._warn import warn
from fullbatch._engine._core import Handle
from fullbatch._engine._run import abandon_locally

__all__ = ["FirstWindowCheck", "refuse_coupled"]


class FirstWindowCheck:
    """Pending until one window had a micro-batch with two rows (then checked once).

    >>> check = FirstWindowCheck()
    >>> check.pending, check.report
    (True, None)
    """

    def __init__(self) -> None:
        self.pending = True
        self.report: PackingReport | None = None

    def __call__(self, window: Handle, fn: Any) -> None:
        engine = window._engine
        model = engine.model
        if engine.sync.kind == "fsdp2":
            self.pending = False
            warn(
                "pack=True under FSDP2: window.run cannot check packing on sharded "
                "parameters; run fb.verify(model, batch, loss_fn, micro_batch_tokens=T, "
                "pack=True) on the model before fully_shard (Accumulator(..., "
                "verify_pack=False) silences this)."
            )
            return
        micros = [m for m in window._state.feed.real if isinstance(m, dict)]
        ddp = model if isinstance(model, DistributedDataParallel) else None
        # Under DDP no collective may run here (ranks check different rows): no gradient
        # sync, and no buffer broadcast in the forward (DDP's require_forward_param_sync).
        sync = ddp.no_sync() if ddp is not None else contextlib.nullcontext()
        broadcast = ddp.require_forward_param_sync if ddp is not None else False
        snapshot = ModelSnapshot.capture(model)
        dropout = disable_dropout(model)

        def call(micro: Any) -> Any:
            out = fn(micro)
            return (out, 1.0) if isinstance(out, torch.Tensor) else out

        try:
            if ddp is not None:
                ddp.require_forward_param_sync = False
            with torch.enable_grad(), sync:
                report = _check(model, call, micros)
        except BaseException:
            abandon_locally(window)
            raise
        finally:
            if ddp is not None:
                ddp.require_forward_param_sync = broadcast
            dropout.restore()
            snapshot.restore()
        if report is None:
            return  # no micro-batch with two rows yet: the next window is checked
        self.pending = False
        self.report = report
        if not report.passed:
            abandon_locally(window)
            raise ValueError(
                "pack=True: packing does not respect the row boundaries on this model, so "
                "training on packed micro-batches would not be the full-batch step; nothing "
                f"was changed.\n{report}"
            )


def _check(model: Any, call: Any, micros: list[Any]) -> PackingReport | None:
    """``check_packed`` on the first micro-batch with two rows or more. Its padded arm needs
    up to rows x longest row tokens: on an out-of-memory error it checks the micro-batch's
    shorter half of rows, down to its two shortest."""
    multi = [m for m in micros if len(m["cu_seq_lens_q"]) > 2]
    if not multi:
        return None
    micro = multi[0]
    rows = len(micro["cu_seq_lens_q"]) - 1
    keep = rows
    while True:
        try:
            return check_packed(model, call, [repack(micro, range(rows - keep, rows))], limit=1)
        except torch.OutOfMemoryError:
            if keep <= 2:
                raise
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        keep = max(keep // 2, 2)


def refuse_coupled(window: Handle) -> None:
    """``window.run_coupled`` with ``pack=True``: refused (window abandoned, nothing changed)."""
    abandon_locally(window)
    raise ValueError(
        "window.run_coupled needs representations with one row per example, but pack=True "
        "puts a micro-batch's rows into one packed row. Use micro_batch_tokens=T without "
        "pack (sorted and trimmed rows) for coupled losses."
    )

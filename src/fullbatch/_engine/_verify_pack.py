"""The packing checks of ``pack=True``, before the first packed micro-batch of two rows changes
anything. A failure abandons the window and raises ``ValueError`` with the cause; parameters,
gradients, optimizer state and the RNG are untouched. Opt out with
``Accumulator(..., verify_pack=False)``.

- ``window.run(fn)``: the micro-batch is run packed and padded through ``fn`` (see
  :mod:`fullbatch._base._row_boundaries`): gradient and leak. Cost: about one window, once.
- The plain ``for micro in window`` loop (fullbatch never sees the loss function): the
  user's own forward of that micro-batch is watched (the model's output and its
  ``nn.Embedding`` outputs, by forward hooks), and before its first backward one row's
  outputs are differentiated with respect to the other rows' input embeddings, for the last
  row (leaks from earlier rows: the cache left on, a 2-D mask, no ``position_ids``) and the
  first (a bidirectional encoder). Packing that respects row boundaries gives exactly 0.
  Cost: two partial backward passes, once; no forward, no RNG draw, no ``.grad`` written.

Under DDP the checks run on each rank without a collective (no gradient sync, no buffer
broadcast); under FSDP2 they cannot run on sharded parameters and say so once.
"""

from __future__ import annotations

import gc
import itertools
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from fullbatch._base._modelstate import ModelSnapshot, disable_dropout
from fullbatch._base._row_boundaries import PackingReport, check_packed, likely_causes, repack
from fullbatch._base._sync import Sync
from fullbatch._base._warn import warn
from fullbatch._engine._core import Handle
from fullbatch._engine._run import abandon_locally
from fullbatch._engine._state import WindowState
from fullbatch._engine._watch import Watch

__all__ = ["FirstWindowCheck", "refuse_coupled"]


class FirstWindowCheck(Watch):
    """Pending until one window had a micro-batch with two rows (then checked once).

    In the plain loop it is a :class:`~fullbatch._engine._watch.Watch`: it watches the
    forward of the first packed micro-batch of two rows and checks it before that
    micro-batch's first backward (then drops out of the list); :meth:`Window.run` calls it
    instead (``check(window, fn)``).

    >>> model = torch.nn.Linear(1, 1)
    >>> check = FirstWindowCheck(model, Sync(model))
    >>> check.pending, check.report
    (True, None)
    """

    def __init__(self, model: nn.Module, sync: Sync) -> None:
        self._model = model
        self._sync = sync
        self.pending = True
        self.report: PackingReport | None = None
        self.watch: _Watch | None = None  # the plain loop's watched micro-batch

    # -- the plain loop ------------------------------------------------------------------------

    def on_micro_batch(self, state: WindowState, micro: Any) -> bool:
        """The plain loop yields ``micro``: watch its forward if it packs two rows or more."""
        if self.watch is not None:
            self.watch.close()  # its backward never came
            self.watch = None
        if not self.pending:
            return True  # checked (by window.run, or by this watch)
        if state.by_run or not isinstance(micro, Mapping):
            return False
        if len(micro.get("cu_seq_lens_q", ())) <= 2:
            return False
        if self._sync.sharded:
            self.pending = False
            warn(_FSDP2)
            return True
        self.watch = _Watch(self._sync.inner, micro)
        return False

    def before_backward(self, state: WindowState, loss: torch.Tensor, count: Any) -> bool:
        """The first backward of the watched micro-batch: refuse it if rows leak."""
        watch, self.watch = self.watch, None
        if watch is None:
            return not self.pending
        watch.close()
        self.pending = False
        leaks = watch.leaks()  # an error here abandons the window too
        if leaks is None:
            warn(
                "pack=True: the plain loop could not check that packing respects the row "
                "boundaries (no model output and nn.Embedding output of the packed row's shape "
                "[1, n, ...] in the forward of the first packed micro-batch). Run "
                "fb.verify(model, batch, loss_fn, micro_batch_tokens=T, pack=True), or train "
                "with window.run(fn), which checks the loss end to end "
                "(Accumulator(..., verify_pack=False) silences this)."
            )
            return True
        earlier, later = leaks
        if earlier == 0.0 and later == 0.0:
            return True
        causes = likely_causes(self._model, watch.kwargs, [watch.micro], later > 0)
        lines = "\n".join(f"  likely cause: {cause}" for cause in causes)
        raise ValueError(
            "pack=True: packing does not respect the row boundaries in this loop's forward: "
            "a row's outputs depend on other rows' tokens (gradient "
            f"{max(earlier, later):.1e} on their input embeddings, must be 0), so training on "
            "packed micro-batches would not be the full-batch step; nothing was changed.\n"
            f"{lines}"
        )

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()
            self.watch = None

    # -- window.run ----------------------------------------------------------------------------

    def __call__(self, window: Handle, fn: Any) -> None:
        engine = window._engine
        model = engine.model
        if engine.sync.sharded:
            self.pending = False
            warn(_FSDP2)
            return
        micros = [m for m in window._state.feed.real if isinstance(m, dict)]
        snapshot = ModelSnapshot.capture(model)
        dropout = disable_dropout(model)

        def call(micro: Any) -> Any:
            out = fn(micro)
            return (out, 1.0) if isinstance(out, torch.Tensor) else out

        try:
            # Under DDP no collective may run here (ranks check different rows).
            with torch.enable_grad(), engine.sync.no_collectives():
                report = _check(model, call, micros)
        except BaseException:
            abandon_locally(window)
            raise
        finally:
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


_FSDP2 = (
    "pack=True under FSDP2: fullbatch cannot check packing on sharded parameters; run "
    "fb.verify(model, batch, loss_fn, micro_batch_tokens=T, pack=True) on the model before "
    "fully_shard (Accumulator(..., verify_pack=False) silences this)."
)


def _first_tensor(out: Any) -> Any:
    """A model output's logits: ``.logits``, a tensor, or the first tensor of a tuple."""
    if isinstance(out, torch.Tensor):
        return out
    logits = out.get("logits") if isinstance(out, Mapping) else getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(out, (tuple, list)):
        return next((t for t in out if isinstance(t, torch.Tensor)), None)
    return None


class _Watch:
    """Forward hooks during the plain loop's first packed micro-batch of two rows or more."""

    def __init__(self, model: nn.Module, micro: Mapping[str, Any]) -> None:
        self.micro = dict(micro)
        bounds = [int(b) for b in micro["cu_seq_lens_q"].tolist()]
        self.spans = list(itertools.pairwise(bounds))
        self.n = bounds[-1]
        self.kwargs: dict[str, Any] | None = None
        self.output: Any = None
        self.embeddings: list[torch.Tensor] = []
        self._handles = [
            model.register_forward_pre_hook(self._call, with_kwargs=True),
            model.register_forward_hook(self._out),
        ] + [m.register_forward_hook(self._embedded) for m in model.modules() if _is_embedding(m)]

    def _packed(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[:2] == (1, self.n)

    def _call(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if self.kwargs is None:
            self.kwargs = dict(kwargs)

    def _out(self, module: nn.Module, args: Any, output: Any) -> None:
        logits = _first_tensor(output)
        if self.output is None and self._packed(logits) and logits.requires_grad:
            self.output = logits

    def _embedded(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._packed(output) and output.requires_grad:
            self.embeddings.append(output)

    def leaks(self) -> tuple[float, float] | None:
        """Largest |gradient| of the last row's outputs on earlier rows' embeddings, and of
        the first row's on later rows'; None when the forward gave nothing to probe."""
        if self.output is None or not self.embeddings:
            return None
        g = torch.Generator().manual_seed(0)
        out = self.output

        def leak(row: int) -> float:
            start, stop = self.spans[row]
            weights = torch.randn(out[0, start:stop].shape, generator=g, dtype=torch.float64)
            probe = (out[0, start:stop] * weights.to(out.device, out.dtype)).sum()
            grads = torch.autograd.grad(
                probe, self.embeddings, retain_graph=True, allow_unused=True
            )
            worst = 0.0
            for grad in grads:
                if grad is not None:
                    other = torch.cat([grad[0, :start], grad[0, stop:]])
                    worst = max(worst, float(other.abs().max()) if other.numel() else 0.0)
            return worst

        return leak(len(self.spans) - 1), leak(0)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _is_embedding(module: nn.Module) -> bool:
    return isinstance(module, nn.Embedding)


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

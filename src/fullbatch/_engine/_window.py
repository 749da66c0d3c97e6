"""``Window``: the micro-batches between two optimizer steps, and the user's handle on them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from fullbatch._base._normalize import check_count
from fullbatch._base._stats import StepStats
from fullbatch._engine._auto import run_auto
from fullbatch._engine._core import Engine
from fullbatch._engine._coupled import run_coupled
from fullbatch._engine._run import abandon_locally, run_window
from fullbatch._engine._state import Phase, WindowState
from fullbatch._engine._stats_pass import window_stats
from fullbatch._engine._step import discard_window, step_window
from fullbatch._engine._verify_pack import refuse_coupled

__all__ = ["Window"]

_FINAL_BACKWARD_FIX = (
    "Every rank must call window.backward on its final micro-batch, even when it counts no "
    "items: pass count=0 instead of skipping it (an `if n == 0: continue` there breaks DDP's "
    "and FSDP's gradient synchronization, which happens in that backward)."
)


class Window:
    """The micro-batches of one optimizer step. Made by :meth:`Accumulator.windows`.

    Iterate it once; call :meth:`backward` for each micro-batch it yields (once or several
    times), then :meth:`step` (or :meth:`discard`). ``len(window)`` is the number of
    micro-batches iteration yields, padding micro-batches included.

    Example::

        for window in acc.windows(loader):
            for micro in window:
                loss_sum, n = fb.cross_entropy_sum(model(micro["x"]), micro["y"])
                window.backward(loss_sum, n)
            stats = window.step()
    """

    #: What this route is called, for ``fb.probe`` (a declaration: see
    #: ``fullbatch._probe._engines``).
    fullbatch_route = "fb.Accumulator"

    def __init__(self, engine: Engine, state: WindowState) -> None:
        self._engine = engine
        self._state = state

    def fullbatch_clip(self) -> tuple[float, float, float] | None:
        """The clip folded into the multiply of the step being taken, as ``fb.probe`` reports
        it: ``(max_grad_norm, the norm before the clip, its coefficient)``; None without one.
        """
        verdict, limit = self._engine.verdict, self._engine.step_plan.max_grad_norm
        if verdict is None or limit is None or not verdict.clip < 1.0:
            return None
        return limit, verdict.grad_norm, verdict.clip

    def fullbatch_padding(self) -> int:
        """The zero-weight padding micro-batches this window runs over every rank (the same
        number on every rank), for ``fb.probe``: it cannot tell them from micro-batches."""
        return self._state.padding

    @property
    def index(self) -> int:
        """The window's position among this ``acc.windows(loader)``'s windows, from 0."""
        return self._state.index

    @property
    def loss_scale(self) -> float:
        """``c``: the power of two every count-form loss is multiplied by before backward."""
        return self._state.loss_scale

    # -- iteration -------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        state = self._state
        if state.phase in (Phase.ITERATING, Phase.EXHAUSTED):
            raise RuntimeError(
                f"window {self.index} is being iterated a second time; a window yields its "
                "micro-batches once. Keep them in a list inside the loop if you need them again."
            )
        if state.phase is Phase.OPEN:
            state.phase = Phase.ITERATING
        plan = self._engine.micro_plan
        if plan.is_auto and not state.by_run:
            raise RuntimeError(
                f"{plan.size_name}='auto' needs window.run(fn): fullbatch must call your "
                "per-micro-batch function to catch an out-of-memory error, and Python does not "
                "hand an exception raised in a `for` body back to the iterator. Write "
                "`stats = window.run(lambda micro: fb.cross_entropy_sum(model(micro['x']), "
                f"micro['y']))`, or give an integer {plan.size_name}."
            )
        return self

    def __next__(self) -> Any:
        self._engine.sync.end()
        if self._state.phase.closed:
            raise RuntimeError(f"window {self.index} was already stepped or discarded.")
        item = self._state.feed.pop()
        if item is None:
            self._state.phase = Phase.EXHAUSTED
            raise StopIteration
        state = self._state
        micro, state.current_final, state.current_padding = item
        state.current_backwards = 0
        state.yielded += 1
        self._engine.watches.on_micro_batch(state, micro)
        # The sync state is chosen before the forward: DDP and FSDP decide at forward time.
        self._engine.sync.begin(state.current_final)
        return micro

    def __len__(self) -> int:
        return self._state.yielded + self._state.feed.remaining()

    @property
    def is_padding(self) -> bool:
        """True while the current micro-batch is padding: its loss and count are ignored."""
        return self._state.current_padding

    @property
    def totals(self) -> dict[str, float]:
        """Global totals of the Accumulator's ``counts=`` functions over this window.

        Raises:
            RuntimeError: the Accumulator was built without ``counts=``.
        """
        if self._state.totals is None:
            raise RuntimeError(
                "window.totals needs counts= on the Accumulator, e.g. "
                "fb.Accumulator(..., counts={'tokens': lambda m: fb.count_tokens(m['labels'])})."
            )
        self._state.totals_read = True
        return dict(self._state.totals)

    def stats(
        self, fn: Callable[[Any], Any], *, reduce: str = "sum", key: str | None = None
    ) -> Any:
        """A window statistic: ``fn`` on every micro-batch and rank, once, before the first
        backward, no gradients; ``reduce="sum"`` (float64) or ``"cat"`` (dim 0, ranks in order),
        kept under ``key`` for a second call, an "auto" retry and a resume (docs/moe.md)."""
        return window_stats(self, fn, reduce=reduce, key=key)

    # -- backward --------------------------------------------------------------------------

    def _check_open(self, what: str) -> None:
        if self._state.phase.closed:
            raise RuntimeError(
                f"{what} on window {self.index}, which was already stepped or discarded. "
                "Use the next window from acc.windows(loader)."
            )

    def backward(self, loss: torch.Tensor, count: Any = None, **autograd_kwargs: Any) -> None:
        """Backpropagate ``loss`` for the current micro-batch.

        Args:
            loss: a 0-dim tensor. With ``count``: the loss *summed* over ``count`` items.
                Without: the user's share of the global objective, already divided by a
                ``window.totals`` entry (needs ``counts=`` on the Accumulator).
            count: what this call adds to the window's denominator: a finite number >= 0
                (int, float or 0-dim tensor; real-valued weights allowed). A second loss term
                over the same items passes ``count=0``.
            **autograd_kwargs: passed to autograd, e.g. ``retain_graph=True``.

        Raises:
            ValueError: a bad count or loss, a count-less call without ``counts=``, or the
                two forms mixed in one window.
            RuntimeError: no current micro-batch (before the first, after the last, after
                ``step()``/``discard()``), or a second backward on DDP's synced micro-batch.
        """
        self._check_open("backward()")
        exhausted = self._state.phase is Phase.EXHAUSTED
        if exhausted or self._state.yielded == 0:
            where = "after the window was exhausted" if exhausted else "before iterating"
            raise RuntimeError(
                f"backward() {where}: a backward belongs to the micro-batch the window last "
                "yielded. Call it inside `for micro in window:`."
            )
        form = "share" if count is None else "count"
        if form == "share" and self._engine.micro_plan.counts is None:
            raise ValueError(
                "window.backward(loss) without a count needs counts= on the Accumulator: "
                "without it the loss is almost surely a per-micro-batch mean, which weights "
                "micro-batches wrongly. Pass the summed loss and its item count, e.g. "
                "`loss_sum, n = fb.causal_lm_loss(logits, labels); window.backward(loss_sum, n)`."
            )
        if self._state.form is not None and form != self._state.form:
            raise ValueError(
                "this window mixes backward(loss, count) and backward(share) calls; use one "
                "form per window: with a count for summed losses, or without for shares "
                "divided by window.totals."
            )
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(f"loss must be a 0-dim tensor, got {shape}; sum it first.")
        if not loss.requires_grad:
            raise ValueError(
                "loss does not require grad: it was computed under torch.no_grad() or from "
                "detached tensors, so backward would change nothing."
            )
        sync = self._engine.sync
        if self._state.current_backwards > 0 and sync.single_backward(self._state.current_final):
            raise RuntimeError(
                "a second backward on the micro-batch where DDP synchronizes: DDP reduces "
                "only the first backward after a synced forward (pytorch#47260). Sum the loss "
                "terms into one backward, or build the Accumulator with ddp_sync='step'."
            )
        checked = check_count(count) if form == "count" else 0.0
        watches = self._engine.watches
        try:  # the checks of the loop (_checks.py): one that raises ends the window first
            watches.before_backward(self._state, loss, count)
        except BaseException:
            abandon_locally(self)
            raise
        if loss.dim():
            loss = loss.reshape(())
        if self._state.current_padding:
            # Zero weight by selection, not by multiplying by zero: an inf loss on a padding
            # micro-batch would otherwise become NaN (inf * 0) and poison the window.
            off = torch.zeros((), dtype=torch.bool, device=loss.device)
            target = torch.where(off, loss, torch.zeros_like(loss))
            scaler = self._engine.step_plan.scaler
            torch.autograd.backward(
                target if scaler is None else scaler.scale(target), **autograd_kwargs
            )
        else:
            # Seeding backward with c (times the GradScaler's scale) is backward(c · loss)
            # without an extra multiply in the graph: c is a power of two, so both are exact.
            torch.autograd.backward(loss, grad_tensors=self._seed(loss, form), **autograd_kwargs)
        buffers = self._engine.grad_buffers
        if buffers is not None:  # accumulate_dtype: move .grad into the buffers
            buffers.after_backward()
        watches.after_backward(self._state)
        self._record(loss, checked, form)

    def _seed(self, loss: torch.Tensor, form: str) -> torch.Tensor:
        """The gradient backward starts from: ``c`` (count form) or 1, times the scaler's scale.

        Cached per dtype and device for the window (neither c nor the scale change inside it).
        """
        key = (form, loss.dtype, loss.device)
        seed = self._state.seeds.get(key)
        if seed is None:
            c = self.loss_scale if form == "count" else 1.0
            seed = torch.full((), c, dtype=loss.dtype, device=loss.device)
            scaler = self._engine.step_plan.scaler
            if scaler is not None:
                seed = scaler.scale(seed)
            self._state.seeds[key] = seed
        return seed

    def _record(self, loss: torch.Tensor, count: float | torch.Tensor, form: str) -> None:
        self._state.form = form
        self._state.backwards += 1
        self._state.current_backwards += 1
        self._state.final_backward = self._state.final_backward or self._state.current_final
        if self._state.current_padding:
            return
        # Kept as they are and summed once at the step: no extra device work per micro-batch.
        self._state.losses.append(loss.detach())
        if isinstance(count, torch.Tensor):
            self._state.device_counts.append(count)
        else:
            self._state.count_py += count

    # -- the whole window in one call ----------------------------------------------------------

    def run(self, fn: Callable[[Any], Any]) -> StepStats:
        """Run ``fn`` on every micro-batch, backpropagate what it returns, and step.

        The same machinery as the plain loop (sync, counts, padding micro-batches, skips):
        ``fn`` runs on padding micro-batches too (``window.is_padding`` tells). It is the
        entry point ``micro_batch_size="auto"`` needs: on ``torch.OutOfMemoryError`` the
        window is re-run from its start with half the micro-batch size.

        Args:
            fn: ``fn(micro) -> (loss_sum, count)``, as passed to :meth:`backward`; with
                ``counts=`` on the Accumulator it may instead return a 0-dim share already
                divided by a ``window.totals`` entry.

        Returns:
            The window's :class:`StepStats` (``retries``: re-runs of the window under "auto").

        Raises:
            ValueError: ``fn`` returned something else, or what :meth:`backward` refuses.
            Exception: whatever ``fn`` raises propagates after the window is abandoned on this
                rank (gradients cleared, sync flags restored; no collective: the other ranks
                fail at their next collective, as with the plain loop).

        Example::

            for window in acc.windows(loader):
                stats = window.run(lambda m: fb.cross_entropy_sum(model(m["x"]), m["y"]))
        """
        self._check_open("run()")
        self._state.by_run = True
        check = self._engine.pack_check
        if check is not None and check.pending:  # pack=True: proven before anything changes
            check(self, fn)
        if self._engine.micro_plan.is_auto:
            return run_auto(self, fn)
        return run_window(self, fn)

    def run_coupled(
        self, encode: Callable[[Any], Any], loss: Callable[[Any, slice], Any]
    ) -> StepStats:
        """Exact accumulation for a loss that couples rows (contrastive, in-batch negatives).

        Pass 1 runs ``encode`` on every micro-batch without graphs; ``loss`` runs once on the
        representations of the whole window (under DDP/FSDP2: every rank's, in rank order,
        so negatives span the global batch) and its gradient with respect to them is kept;
        pass 2 re-runs each micro-batch with graphs, the RNG state replayed (dropout masks
        equal pass 1's), and backpropagates that gradient. The step equals one full-batch
        step of ``loss`` on the whole window. Cost: one extra forward per micro-batch;
        memory: one micro-batch's graph plus the window's representations.

        Args:
            encode: ``encode(micro)`` -> a tensor or a tuple of tensors (e.g. query and
                document embeddings), rows first.
            loss: ``loss(reps, rows)`` -> ``(loss_sum, count)``: ``reps`` is like
                ``encode``'s output for the whole window (requires grad), ``rows`` the slice
                of this rank's rows in it; the loss is summed over those rows and ``count``
                counts them. Normalization by the global count happens at the step.

        Returns:
            The window's :class:`StepStats` (``loss``: the global loss sum over the count;
            ``retries``: re-runs of the window under "auto").

        Raises:
            ValueError: ``encode`` or ``loss`` returned something else.
            RuntimeError: the window was already iterated, or ``encode`` gave different
                shapes in pass 2.
            torch.OutOfMemoryError: under ``"auto"``, at one row per micro-batch (earlier
                ones halve the size and re-run both passes of the window from its start).

        Example::

            def encode(micro):
                return q_tower(micro["q"]), d_tower(micro["d"])

            def info_nce(reps, rows):
                q, d = reps
                logits = q[rows] @ d.T / 0.05
                return fb.cross_entropy_sum(logits, torch.arange(len(d))[rows])

            for window in acc.windows(loader):
                stats = window.run_coupled(encode, info_nce)
        """
        self._check_open("run_coupled()")
        if self._engine.micro_plan.pack:
            refuse_coupled(self)
        return run_coupled(self, encode, loss)

    # -- the end of the window -------------------------------------------------------------

    def step(self) -> StepStats:
        """Normalize the accumulated gradient and take one optimizer step (or skip it).

        Order: all-reduce of loss sum, count and flags → GradScaler unscale → normalize →
        clip (the reported norm is before clipping) → optimizer step (skipped on zero items or
        non-finite loss/gradient) → scaler update → scheduler step → ``zero_grad``.

        Raises:
            RuntimeError: called twice, before every micro-batch was yielded, with no
                backward, or without a backward on the final micro-batch.
            ValueError: a count given as a device tensor was negative or non-finite (the
                window is discarded first, so nothing is lost).
        """
        self._check_open("step()")
        self._engine.sync.end()
        if self._state.phase is not Phase.EXHAUSTED and self._state.feed.remaining() > 0:
            raise RuntimeError(
                f"step() before every micro-batch of window {self.index} was yielded "
                f"({self._state.yielded} of {len(self)}; an early `break`?). Finish the loop, or "
                "call window.discard() to abandon the window."
            )
        if self._state.backwards == 0 and self._state.yielded > 0:
            raise RuntimeError(
                f"step() on window {self.index} with no backward call: call "
                "window.backward(loss_sum, count) for each micro-batch, or window.discard()."
            )
        if not self._state.final_backward and self._state.yielded > 0:
            raise RuntimeError(f"the final micro-batch had no backward. {_FINAL_BACKWARD_FIX}")
        try:  # e.g. gradients cleared after the last backward: the window ends first
            self._engine.watches.before_step(self._state)
        except BaseException:
            abandon_locally(self)
            raise
        self._state.phase = Phase.STEPPING
        return step_window(self._engine, self._state)

    def discard(self) -> None:
        """Abandon the window: clear gradients and restore sync flags. No step is taken.

        Under DDP/FSDP2 it is collective: every rank discards the same window.
        """
        if self._state.phase.closed:
            return
        discard_window(self._engine, self._state)


# Reprs and pickles say fullbatch.Window, wherever the class is defined; doctest still
# finds its examples here.
Window.__module__ = "fullbatch"
__test__ = {"Window": Window}

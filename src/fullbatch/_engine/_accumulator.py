"""``Accumulator``: owns the invariants of accumulation (windows, normalization, sync, the
order at the step); the training loop stays the user's."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from fullbatch._base._sort_trim import Lengths
from fullbatch._base._sync import SyncPlan
from fullbatch._engine._batchnorm import WindowBatchNorm, warn_batchnorm
from fullbatch._engine._boosted import check_optimizer, unwrap_boosted
from fullbatch._engine._checks import engine_watches
from fullbatch._engine._core import Engine
from fullbatch._engine._feed import Feed, Stream
from fullbatch._engine._guards import LoopGuard
from fullbatch._engine._hooks import WindowHooks
from fullbatch._engine._loader_checks import LoaderChecks
from fullbatch._engine._micro_plan import MicroBatchPlan, on_accelerator
from fullbatch._engine._mistakes import warn_untrained
from fullbatch._engine._open import open_window
from fullbatch._engine._precision import make_grad_buffers
from fullbatch._engine._prepared import Prepared, check_loader
from fullbatch._engine._resume import Resume
from fullbatch._engine._step_plan import StepPlan, trained_params
from fullbatch._engine._verify_pack import FirstWindowCheck
from fullbatch._engine._window import Window
from fullbatch._engine._windows import Windows

__all__ = ["Accumulator"]


class Accumulator:
    """Gradient accumulation whose every step equals the full-batch step.

    Args:
        model: a plain module, a ``DistributedDataParallel`` model or an FSDP2
            (``fully_shard``) model.
        optimizer: stepped once per window, with the normalized gradient. An Accelerate
            ``AcceleratedOptimizer`` is unwrapped: fullbatch hooks and steps the optimizer it
            wraps (``acc.optimizer``); give its GradScaler as ``scaler=accelerator.scaler``.
            ColossalAI's boosted objects (``TorchDDPPlugin``) are unwrapped too: the DDP
            model inside the boosted model (``acc.model``), the optimizer inside the
            ``OptimizerWrapper``. Plugins that keep gradients outside ``.grad`` (ZeRO, Gemini)
            are refused.

    **How a loader item becomes micro-batches** (exactly one of the three sizes):

    Args:
        micro_batches: the loader yields micro-batches; this many per rank make a window.
        micro_batch_size: the loader yields whole windows; each is split into micro-batches
            of this many rows (tensors with rows first; other leaves go to every micro-batch).
            ``"auto"`` (for either size, only with :meth:`Window.run` or
            :meth:`Window.run_coupled`): start from the whole window, halve on
            ``torch.OutOfMemoryError`` and re-run the window from its start; the size that
            worked is kept (``acc.micro_batch_size`` / ``acc.micro_batch_tokens``). Under DDP
            it needs ``ddp_sync="step"`` (the default with it).
        micro_batch_tokens: the loader yields whole windows; each window's rows are sorted by
            length (longest first) and cut into micro-batches of at most this many padded
            tokens (rows x longest row), each trimmed to its own longest row. A row longer
            than the budget is a micro-batch of its own (warned once). Exact: regrouping rows
            and cutting trailing padding change nothing but rounding. An integer or ``"auto"``.
        sort_rows: with ``micro_batch_size``: sort each window's rows by length first and trim
            each micro-batch to its own longest row (same rows per micro-batch, less padding).
        pad_to_multiple_of: with ``micro_batch_tokens`` or ``sort_rows``: round each trimmed
            micro-batch's width (a packed row's length) up to a multiple of this, so that a
            GPU meets few distinct shapes (each new one costs an attention plan, a compiled
            graph). The columns added past the window's width hold each key's padding
            (``labels`` -100, masks 0, other token keys the window's own padding value); the
            count is unchanged and each step still equals the full batch; with
            ``micro_batch_tokens``, rows x rounded width stays within the budget (a single
            longer row aside). ``None``: 64 when the model is on a GPU (or another
            accelerator), exact widths on a CPU; ``1``: exact widths everywhere.
        lengths: the rows' lengths for ``micro_batch_tokens`` / ``sort_rows``: a key of the
            loader item whose nonzero entries per row count the real tokens (default
            ``"attention_mask"``, right padding), or ``fn(item) -> 1-D integer tensor``.
            Per-token tensors are trimmed (see ``token_keys``); other tensors with rows first
            follow their rows; other leaves go to every micro-batch. A mask that is not
            right-padded (left padding) is regrouped but not trimmed (still exact; warned
            once). A missing key raises ``ValueError``.
        token_keys: with ``micro_batch_tokens`` or ``sort_rows``: the keys holding one value
            per token, trimmed with the rows (or packed). ``None``: the lengths key and the
            usual token keys (``input_ids``, ``attention_mask``, ``labels``,
            ``position_ids``, ``token_type_ids``, ...); another tensor whose dimension 1
            equals the padded length is refused with ``ValueError`` (one value per token or
            per row? a guess would cut per-row data). Given: exactly these keys are trimmed;
            other tensors follow their rows whole.
        pack: with ``micro_batch_tokens=T``: pack each window's rows (right-padded) first-fit-
            decreasing into micro-batches of at most ``T`` real tokens, each one packed row
            (``position_ids`` restarting at every row, each row's first label ``-100``, no
            ``attention_mask``, ``cu_seq_lens_q/k``, ``max_length_q/k``, ``use_cache=False``):
            no padding is computed. Exact only where the model's attention honours the row
            boundaries: :meth:`Window.run` checks that on the first packed window and raises
            before anything changes when they are not. Rows are never split; per-row tensors
            are refused.
        verify_pack: with ``pack=True``, let :meth:`Window.run` check packing on the first
            window holding a micro-batch of two rows (about one window's cost, once; the plain
            ``for micro in window`` loop checks the first such micro-batch's own forward
            before its backward: no row's outputs may depend on another row's tokens).
            ``False`` skips both.
        partial_window: ``"step"`` steps a last, shorter window normalized by its own count;
            ``"drop"`` drops it on every rank (only with ``micro_batches``).
        padding_micro_batch: a callable returning a micro-batch for ranks that run padding
            micro-batches (distributed); by default the rank's last real micro-batch is used.
        counts: ``{name: fn(micro) -> number}``; their global sums over the window are
            ``window.totals`` before the first backward (the window is read ahead).

    **Sync** (how counts and gradients are combined over ranks):

    Args:
        ddp_sync: ``"last"`` (each rank's last micro-batch synchronizes) or ``"step"`` (one
            bucketed all-reduce at ``step()``: several backward calls, ranks with no data).
            Default: ``"last"``, or ``"step"`` with an ``"auto"`` size, which needs it (a rank
            that runs out of memory must be able to stop anywhere, so no collective may run
            inside a backward); ``ddp_sync="last"`` with ``"auto"`` raises ``ValueError``.
        fsdp_sync: ``"window"`` (reduce-scatter once, on the last micro-batch; the default on
            a 1-D mesh), ``"micro_batch"`` (every micro-batch; less memory) or, on a 2-D
            (replicate, shard) HSDP mesh, ``"hybrid"`` (reduce-scatter every micro-batch, the
            cross-replica all-reduce once per window; the default there).
        grad_divisor: what a custom DDP comm hook divides gradients by (1 for a summing hook).
        process_group: checked against the wrapper's group; a different one raises.
        context_parallel: the process group of ranks holding other pieces of this rank's rows
            (context parallelism). Each rank counts the items it holds; counts are summed
            over data-parallel x context-parallel ranks, and gradients over the CP group at
            ``step()`` unless the wrapper's group already contains it.
        data_mesh_dims: on a composed ``DeviceMesh`` (tensor parallelism beside FSDP2), the
            names of the parameters' mesh dims that hold different items, e.g. ``("dp",)``.
            Not needed: they are discovered (FSDP2's and DDP's meshes and groups are data
            dims; every other dim of a DTensor parameter's mesh is a model dim, whose ranks
            hold the same items). Given, it pins that layout: ``ValueError`` when the
            wrapper reduces over other dims.

    **The step**:

    Args:
        scheduler: stepped once per optimizer step (not on skipped windows). An Accelerate
            ``AcceleratedScheduler`` keeps its own rule (``num_processes`` inner steps per
            optimizer step unless ``split_batches``).
        scaler: a ``torch.amp.GradScaler``; scales each backward, unscales before clipping,
            updated once per window.
        max_grad_norm: clip the total gradient 2-norm to this value (the reported norm is
            the one before clipping).
        accumulate_dtype: ``torch.float32`` keeps a float32 gradient buffer for each bf16/fp16
            parameter across the window (4 bytes per such parameter element); the norm,
            normalization and clipping are computed from it, and the optimizer gets it cast
            once to the parameter's dtype. Wider parameters are untouched. Under DDP it needs
            ``ddp_sync="step"``; not with FSDP2 or a GradScaler (``ValueError``).
        batchnorm: ``"window"`` gives BatchNorm layers the running statistics of the whole
            window; ``None`` warns when the model has BatchNorm layers in training mode.

    Raises:
        ValueError: a bad option, or two that do not go together (the message names the fix);
            nothing is changed.

    Example:
        >>> import torch, fullbatch as fb
        >>> model = torch.nn.Linear(3, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> batch = {"x": torch.randn(5, 3), "y": torch.tensor([0, 1, 1, 0, -100])}
        >>> with fb.Accumulator(model, opt, micro_batch_size=2) as acc:
        ...     for window in acc.windows([batch]):
        ...         for micro in window:
        ...             loss_sum, n = fb.cross_entropy_sum(model(micro["x"]), micro["y"])
        ...             window.backward(loss_sum, n)
        ...         stats = window.step()
        >>> stats.count, stats.micro_batches
        (4.0, 3)
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        # how a loader item becomes micro-batches
        micro_batches: int | None = None,
        micro_batch_size: int | Literal["auto"] | None = None,
        micro_batch_tokens: int | Literal["auto"] | None = None,
        sort_rows: bool = False,
        pad_to_multiple_of: int | None = None,
        lengths: Lengths = "attention_mask",
        token_keys: Collection[str] | None = None,
        pack: bool = False,
        verify_pack: bool = True,
        partial_window: Literal["step", "drop"] = "step",
        padding_micro_batch: Callable[[], Any] | None = None,
        counts: Mapping[str, Callable[[Any], Any]] | None = None,
        # sync
        ddp_sync: Literal["last", "step"] | None = None,
        fsdp_sync: Literal["window", "micro_batch", "hybrid"] | None = None,
        grad_divisor: float | None = None,
        process_group: Any = None,
        context_parallel: Any = None,
        data_mesh_dims: tuple[str, ...] | None = None,
        # the step
        scheduler: Any = None,
        scaler: Any = None,
        max_grad_norm: float | None = None,
        accumulate_dtype: torch.dtype | None = None,
        batchnorm: Literal["window"] | None = None,
    ) -> None:
        # Every option is parsed, and checked, before anything changes.
        micro_plan = MicroBatchPlan(
            micro_batches=micro_batches,
            micro_batch_size=micro_batch_size,
            micro_batch_tokens=micro_batch_tokens,
            sort_rows=sort_rows,
            pad_to_multiple_of=pad_to_multiple_of,
            lengths=lengths,
            token_keys=token_keys,
            pack=pack,
            verify_pack=verify_pack,
            partial_window=partial_window,
            padding_micro_batch=padding_micro_batch,
            counts=counts,
            accelerator=on_accelerator(model),
        )
        sync_plan = SyncPlan(
            ddp_sync=ddp_sync,
            fsdp_sync=fsdp_sync,
            grad_divisor=grad_divisor,
            process_group=process_group,
            context_parallel=context_parallel,
            data_mesh_dims=data_mesh_dims,
        )
        step_plan = StepPlan(
            scheduler=scheduler,
            scaler=scaler,
            max_grad_norm=max_grad_norm,
            accumulate_dtype=accumulate_dtype,
            batchnorm=batchnorm,
        )
        # ColossalAI's boosted DDP model and optimizer, Accelerate's AcceleratedOptimizer:
        # fullbatch syncs the DDP model inside, hooks, steps and clears the inner optimizer.
        model, optimizer = unwrap_boosted(model, optimizer, scaler)
        prepared = Prepared(optimizer, scheduler, scaler)
        optimizer = prepared.optimizer
        check_optimizer(optimizer)
        self.model = model
        self.optimizer = optimizer
        auto = micro_plan.size_name if micro_plan.is_auto else None
        sync = sync_plan.make(model, auto=auto)
        params = trained_params(model, optimizer, distributed=sync.group is not None)
        # Before any hook is registered: a refusal leaves nothing behind.
        buffers = make_grad_buffers(step_plan.accumulate_dtype, params, sync, step_plan.scaler)
        window_bn = WindowBatchNorm(model) if step_plan.window_batchnorm else None
        warn_batchnorm(model, window_statistics=step_plan.window_batchnorm)
        warn_untrained(model, optimizer)
        guard = LoopGuard(optimizer, prepared.watched_scheduler, params)
        self._loader_checks = LoaderChecks(micro_batch_size=micro_plan.fixed_rows)
        pack_check = FirstWindowCheck(model, sync) if micro_plan.checks_packing else None
        self._engine = Engine(
            model=model,
            optimizer=optimizer,
            params=params,
            sync=sync,
            guard=guard,
            prepared=prepared,
            window_hooks=WindowHooks(),
            watches=engine_watches(
                model,
                optimizer,
                sync=sync,
                guard=guard,
                loader=self._loader_checks,
                pack=pack_check,
                scheduler_given=scheduler is not None,
                shares=micro_plan.counts is not None,
                scaler=step_plan.scaler,
            ),
            grad_buffers=buffers,
            batchnorm=window_bn,
            pack_check=pack_check,
            micro_plan=micro_plan,
            step_plan=step_plan,
        )
        self._resume = Resume(self._engine)

    @property
    def steps(self) -> int:
        """Optimizer steps taken so far."""
        return self._engine.counters.steps

    @property
    def skipped_windows(self) -> int:
        """Windows skipped so far (zero items, non-finite loss or gradient)."""
        return self._engine.counters.skipped_windows

    @property
    def micro_batch_size(self) -> int | None:
        """Rows per micro-batch: the integer given, or where ``"auto"`` stands now.

        With ``"auto"``: ``None`` before the first window; then the size the last window ran
        with (its whole row count until an out-of-memory error set a limit; that limit
        afterwards, or the window's rows when it has fewer). ``None`` with ``micro_batches``.
        """
        plan = self._engine.micro_plan
        return plan.size if plan.size_name == "micro_batch_size" else None

    @property
    def micro_batch_tokens(self) -> int | None:
        """Padded tokens per micro-batch: the budget given, or where ``"auto"`` stands now.

        With ``micro_batch_tokens="auto"``: ``None`` before the first window, then the budget
        the last window ran with. ``None`` when micro-batches are sized in rows.
        """
        plan = self._engine.micro_plan
        return plan.size if plan.size_name == "micro_batch_tokens" else None

    # -- windows ---------------------------------------------------------------------------

    def windows(self, loader: Any) -> Windows:
        """The windows of ``loader``, one per optimizer step; the last one may be partial.

        Iterate it once. ``len(acc.windows(loader))`` is the number of windows when the loader
        has a length (the partial last window counts; with ``partial_window="drop"`` it does
        not): use it to size a scheduler or a progress bar.

        Raises:
            RuntimeError: gradients are present when a window starts, the previous window
                was neither stepped nor discarded, ``scheduler.step()`` was called outside
                fullbatch, or the Accumulator is closed.
            ValueError: a loader item cannot be split, or a rank has to pad and cannot; a
                loaded state does not fit the loader, model, optimizer or scheduler, or the
                other ranks' states (on every rank, before anything changes).
        """
        self._check_usable()
        check_loader(loader)
        engine = self._engine
        plan = engine.micro_plan
        self._loader_checks.loader(
            loader, micro_batches=plan.micro_batches, resuming=engine.pending is not None
        )
        return Windows(
            self._iterate(loader), loader, micro_batches=plan.micro_batches, drop=plan.drop
        )

    def _iterate(self, loader: Any) -> Iterator[Window]:
        self._check_usable()
        guard = self._engine.guard
        guard.start_iteration()  # another optimizer's step is refused until the windows end
        try:
            yield from self._each_window(loader)
        finally:
            guard.end_iteration()

    def _each_window(self, loader: Any) -> Iterator[Window]:
        engine = self._engine
        stream = self._resume.stream(loader)
        index = 0
        while True:
            # A loaded scheduler moved legitimately: the window start checks it (every rank).
            resuming = engine.pending is not None or engine.start_problems
            if not resuming and engine.guard.scheduler_moved():
                raise RuntimeError(engine.guard.scheduler_message())
            loader_items = self._resume.taken()
            feed, first_item = self._next_feed(stream)
            state = open_window(
                engine, feed, stream, index=index, loader_items=loader_items, first_item=first_item
            )
            if state is None:
                return
            if state is False:  # dropped
                continue
            window = Window(engine, state)
            yield window
            if not window._state.phase.closed:
                engine.sync.end()
                raise RuntimeError(
                    f"window {index} was neither stepped nor discarded before the next one: "
                    "call window.step() (or window.discard()) at the end of each window."
                )
            index += 1

    def _next_feed(self, stream: Stream) -> tuple[Feed, Any]:
        """The next window's micro-batches, and its first loader item (None: this rank has none)."""
        engine = self._engine
        plan = engine.micro_plan
        if plan.items_are_windows:
            ok, item = stream.next()
            micros = plan.cut(item, ended=not ok)
            if ok and not micros:
                raise ValueError("a loader item has 0 rows; an empty window cannot be stepped.")
            if micros:  # pad with one micro-batch of this rank, never with a whole window
                stream.last = micros[-1]
            return Feed(micros), item if ok else None
        feed = Feed([], stream, plan.micro_batches or 0)
        if plan.reads_ahead or engine.sync.equal_micro_batches:
            feed.fill()
        else:
            feed.lookahead()
        real = feed.real
        return feed, real[0] if real else None

    def register_window_hook(self, fn: Callable[[], Any]) -> RemovableHandle:
        """Call ``fn()`` once per window, on the final gradients, before clipping.

        When ``fn`` runs, every ``p.grad`` is the full-batch gradient of the window: summed
        over all micro-batches and all backward calls (however many loss terms), synced over
        data-parallel ranks (on every rank), unscaled (GradScaler) and normalized by the
        window's count (with ``accumulate_dtype``: computed from the float32 buffers and
        cast to the parameter's dtype). Under FSDP2 each rank's ``p.grad`` is its shard (a
        DTensor). Clipping and the optimizer step come after it.

        This replaces per-backward hooks: ``p.register_post_accumulate_grad_hook`` (and
        ``Tensor.register_hook``) fire once per backward call, so under accumulation they see
        partial, unnormalized sums K times per step (ColossalAI #5601). Move such code
        (gradient logging, noise, projection, custom statistics) into a window hook, e.g.
        ``acc.register_window_hook(lambda: [hook(p) for p in model.parameters()])``.

        Not called on a skipped window (zero items, non-finite loss or gradient): its
        gradients are undefined or not finite and are thrown away, nothing is stepped
        (``stats.skipped`` reports it); nor on a discarded window. A hook may modify
        gradients in place; clipping then multiplies them by the factor computed from
        ``stats.grad_norm``, the norm measured before the hooks ran.

        Returns:
            a handle whose ``.remove()`` unregisters ``fn``.

        Raises:
            ValueError: ``fn`` is not callable.

        Example:
            >>> import torch, fullbatch as fb
            >>> model = torch.nn.Linear(3, 2)
            >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> batch = {"x": torch.randn(6, 3), "y": torch.tensor([0, 1, 1, 0, 1, 0])}
            >>> acc = fb.Accumulator(model, opt, micro_batch_size=2)
            >>> grads = []
            >>> handle = acc.register_window_hook(lambda: grads.append(model.weight.grad.clone()))
            >>> for window in acc.windows([batch]):
            ...     for micro in window:
            ...         out = model(micro["x"])
            ...         loss_sum, n = fb.cross_entropy_sum(out, micro["y"])
            ...         window.backward(loss_sum, n, retain_graph=True)
            ...         window.backward(1e-3 * out.square().sum(), 0)  # 2nd term, same items
            ...     stats = window.step()
            >>> len(grads)  # 3 micro-batches, 6 backward calls: one call, one window
            1
            >>> handle.remove()
        """
        return self._engine.window_hooks.register(fn)

    # -- checkpoint and resume ----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The Accumulator's state, at a window boundary or between two micro-batches.

        Save it next to the model, optimizer, scaler and scheduler states (each rank its
        own). Between micro-batches (after ``window.backward``) it holds the window so far:
        gradients (FSDP2: this rank's shards), loss sums and counts, ``c``, the micro-batches
        done, BatchNorm window statistics. Always: ``steps``, ``skipped_windows``, the RNG
        state and ``state["loader_items"]``, the loader items consumed before the
        interrupted window began (counted over this ``acc.windows(loader)``'s loader, from
        where it was resumed). Tensors, numbers, strings and lists only:
        ``torch.load(path, weights_only=True)`` reads it. See docs/checkpointing.md.

        Raises:
            RuntimeError: a micro-batch is handed out but its ``window.backward`` was not
                called yet (it would be lost): take the state after the backward.

        Example:
            >>> import torch, fullbatch as fb
            >>> model = torch.nn.Linear(3, 2)
            >>> acc = fb.Accumulator(model, torch.optim.SGD(model.parameters()), micro_batches=2)
            >>> state = acc.state_dict()
            >>> state["loader_items"], state["steps"], state["window"]
            (0, 0, None)
        """
        return self._resume.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next ``acc.windows(loader)`` continues the window.

        Load the model, optimizer, scaler and scheduler states too, then call
        ``acc.windows(loader)`` with a loader that starts at item ``state["loader_items"]``:
        the interrupted window is rebuilt from the same items, the micro-batches already
        accumulated are read and skipped (not run), their gradients and sums are put back and
        the RNG state is restored before the first micro-batch computed. On CPU the result is
        bitwise the uninterrupted run's.

        The first window checks, on every rank together and before anything changes, that
        the model's parameters and the optimizer's state are the ones saved with the state
        (integer sums per tensor), the scheduler's and the loader's positions, and that every
        rank loaded the state of the same window and point in it: a mismatch on any rank
        raises ``ValueError`` on every rank. The micro-batch size (``micro_batch_size`` or
        ``micro_batch_tokens``) may differ from the saving run's at a window boundary.

        Raises:
            ValueError: the state is from another world size or rank, sync kind, model
                (parameter names or shapes), mode, ``micro_batches``, or micro-batch size
                inside a window; nothing is changed.
            RuntimeError: a window is open.
        """
        self._resume.load_state_dict(state)

    # -- close -----------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._engine.closed:
            raise RuntimeError("this Accumulator is closed; build a new one.")

    def close(self) -> None:
        """Remove hooks and restore the model's sync flags. Safe to call twice."""
        engine = self._engine
        engine.sync.end()
        if engine.batchnorm is not None:
            engine.batchnorm.close()
        engine.watches.close()  # the loop guard among them: its optimizer hooks go too
        engine.closed = True

    def __enter__(self) -> Accumulator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# Reprs and pickles say fullbatch.Accumulator, wherever the class is defined; doctest still
# finds its examples here.
Accumulator.__module__ = "fullbatch"
__test__ = {"Accumulator": Accumulator}

"""``fb.probe``: check the accumulation of any training code, unchanged, while it runs.

A window's life: its micro-batches are recorded (:mod:`fullbatch._probe._capture`); at the first
optimizer ``step()`` after them the window opens (its reference, before any parameter moves);
every optimizer stepped before the next micro-batch joins it and is read at its own ``step()``;
it closes as soon as every parameter it could check has been stepped, else at the next
``step()`` after new micro-batches, or when the block ends. After the last probed window every
hook goes: at the end of the ``step()`` that closed it (:mod:`fullbatch._probe._hooks`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.optim import optimizer as optimizer_hooks

from fullbatch._base._sync._probe import registered_params
from fullbatch._probe._applied import AppliedGradient, Seen, applied_gradient
from fullbatch._probe._args import (
    DEFAULT_WINDOWS,
    ProbeFinished,
    check_coupled,
    inner_optimizer,
    window_limit,
)
from fullbatch._probe._capture import Capture, micro_batches
from fullbatch._probe._clip import ClipObserver
from fullbatch._probe._coupled import one_per_micro
from fullbatch._probe._early import EarlyReference
from fullbatch._probe._engines import find_engine
from fullbatch._probe._failures import gave_up, padded, run_failed, unsupported
from fullbatch._probe._hooks import Hooks, after_closure
from fullbatch._probe._measure import close
from fullbatch._probe._measured import Measured
from fullbatch._probe._moe_objective import MOE
from fullbatch._probe._report import ProbeReport
from fullbatch._probe._sample import Sampler
from fullbatch._probe._trainer_objective import ObjectiveUnknown, trainer_objective
from fullbatch._probe._verdicts import report_of
from fullbatch._probe._window import OpenWindow, WindowData, trained
from fullbatch._proof._objective import check_objective, infer_objective

# DEFAULT_WINDOWS, ProbeFinished and window_limit live in _args; the command imports them here.
__all__ = [
    "DEFAULT_WINDOWS", "ObjectiveUnknown", "Probe", "ProbeFinished", "probe", "window_limit",
]  # fmt: skip


class Probe:
    """What ``fb.probe(...)`` returns: a context manager; ``report`` says what it found."""

    def __init__(
        self,
        model: nn.Module | None,
        optimizer: Any,
        *,
        objective: Any,
        windows: Any,
        ranks: Any,
        stop: bool = False,
        keep_going: bool = False,
        coupled: bool = False,
    ) -> None:
        if model is not None and not isinstance(model, nn.Module):
            raise ValueError(f"model must be an nn.Module or None, got {type(model).__name__}.")
        self.limit = window_limit(windows)
        if isinstance(ranks, str) and ranks != "local":
            raise ValueError(f"ranks={ranks!r}: pass None, 'local' or a process group.")
        if objective != MOE:  # causal_lm+moe: the probe's own (docs/moe.md)
            objective = check_objective(objective)  # an earlier release's name: warned, renamed
        self.coupled = check_coupled(coupled, objective)
        self.optimizer = None if optimizer is None else inner_optimizer(optimizer)
        self.objective, self.ranks, self.stop = objective, ranks, stop
        self.objective_source = "declared" if objective is not None else ""
        self.keep_going = keep_going  # a failure of the probe's own never stops the run
        self._early = EarlyReference(objective, self.sampler_for)
        self._capture = Capture(
            model, self._first_call, on_call=self._early, on_error=self._hook_failed
        )
        self._clips = ClipObserver()
        self._hooks = Hooks()
        self._samplers: dict[int, Sampler] = {}
        self._leftovers: dict[int, torch.Tensor] = {}
        self._measured: list[Measured] = []
        self._problems: list[str] = []
        self._open: OpenWindow | None = None
        self._outer: tuple[nn.Module, ...] = ()
        self._last: AppliedGradient | None = None  # the last window's reader
        self._windows = 0
        self._done = False
        self._inferred: set[int] = set()  # modules whose objective was inferred
        self.failed: BaseException | None = None  # what the probe's own check raised
        self.failure = ""  # what ended the run with an error (the block's exception)

    # -- the report --------------------------------------------------------------------------

    @property
    def report(self) -> ProbeReport:
        """Every window checked so far, and what kept the probe from checking."""
        report = report_of(self._measured, self._problems, self.limit)
        return replace(report, failure=self.failure) if self.failure else report

    # -- hooks -------------------------------------------------------------------------------

    def __enter__(self) -> Probe:
        self._capture.start()
        self._clips.start()
        if self.optimizer is None:
            self._hooks.add(optimizer_hooks.register_optimizer_step_pre_hook(self._on_step))
        else:
            self._hooks.add(self.optimizer.register_step_pre_hook(self._on_step))
        return self

    def __exit__(self, kind: Any, error: Any, *exc: Any) -> None:
        if kind is not None and kind is not ProbeFinished and error is not self.failed:
            if not (kind is SystemExit and error.code in (None, 0)):
                self.note_failure(f"the run raised {kind.__name__}: {error}")
        try:
            if self._open is not None and not self._done:
                # a window still open closes with the block; after an error, only where no
                # other rank has to join its collectives
                if kind is None or kind is ProbeFinished or self._open.sync.world == 1:
                    self._close(stopping=False)
        finally:
            self._finish()
            self._hooks.remove_all()

    def _finish(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Stop recording and take every hook away: now, or, inside ``optimizer.step()``
        (whose hook loop cannot lose a hook while it runs), the moment that step ends."""
        if self._done:
            return
        self._done = True
        self._open = None
        self._capture.stop()
        self._clips.stop()
        self._early.new_window()  # a window left open: its gradients go
        if optimizer is None:
            self._hooks.remove_all()
        else:
            self._hooks.remove_after_step(optimizer)

    def note_failure(self, text: str) -> None:
        """Say in the report what ended the run with an error (``fullbatch probe``: the
        script's exception or exit status), and in which of the report's windows."""
        if not self.failure:
            self.failure = run_failed(text, self._where())

    def _where(self) -> str:
        """Where the run is, in the report's numbering: in the window being recorded, or right
        after the last window's ``step()`` (nothing recorded since)."""
        if self._done:
            return "after the probed windows" if self.failed is None else "after the probe stopped"
        if self._windows and not self._capture.calls:
            return f"after window {self._windows}'s step"
        return f"in window {self._windows + 1}"

    def _unchecked(self) -> int:
        """The first window a failure now leaves unreported: the open one, else the next."""
        return self._open.window.step if self._open is not None else self._windows + 1

    def _gave_up(
        self, error: Exception, optimizer: torch.optim.Optimizer | None, window: int = 0
    ) -> None:
        """The probe's own check failed in ``window`` (0: the window being checked at this
        ``step()``): say so in the report and stop probing; with ``keep_going`` the run goes
        on, else ``error`` is raised (out of the hook or step)."""
        self.failed = error
        self._problems.append(gave_up(error, window or self._windows, self.keep_going))
        self._open = None
        self._finish(optimizer)
        if not self.keep_going:
            raise error

    def _hook_failed(self, error: Exception) -> None:
        """What a forward hook of the probe raised."""
        if error is self.failed:
            raise error
        self._gave_up(error, None, self._unchecked())

    def sampler_for(self, module: nn.Module) -> Sampler:
        sampler = self._samplers.get(id(module))
        if sampler is None:
            sampler = Sampler([p for p in registered_params(module) if p.requires_grad])
            self._samplers[id(module)] = sampler
        return sampler

    def _first_call(self, module: nn.Module, wrappers: tuple[nn.Module, ...]) -> None:
        """The window's first forward of ``module``: its objective known (asked of the trainer
        that runs, else inferred from the model, else fail now, before anything trained), and
        what gradient it already holds kept."""
        if self.objective is None and not self.objective_source:
            self._paused(self._trainer_objective, None, self._unchecked())
        self._infer(module)
        if self._done:
            return
        sampler = self.sampler_for(module)
        reader = applied_gradient(
            Seen(tuple(sampler.params), (module,), wrappers, ranks=self.ranks)
        )
        if reader.unsupported() is not None:
            return
        grads = reader.leftover()
        if any(g is not None for g in grads):
            self._leftovers[id(module)] = sampler.take(grads)

    def _trainer_objective(self) -> None:
        """The objective the trainer running now trains, where it is known; a trainer whose
        objective is no built-in one stops the run here, before any backward."""
        known = trainer_objective(find_engine())
        if known is None:
            self.objective_source = "the model's head"
            return
        self.objective, self.objective_source = known
        self._early = EarlyReference(self.objective, self.sampler_for)
        self._capture.on_call = self._early

    def _infer(self, module: nn.Module) -> None:
        """With ``objective=None``, a trainable module whose objective cannot be inferred
        fails at its first forward (:class:`ObjectiveUnknown`), not after its window."""
        if self.objective is not None or id(module) in self._inferred:
            return
        self._inferred.add(id(module))
        if not any(p.requires_grad for p in module.parameters()):
            return  # a frozen module (a teacher, a reference model) trains nothing
        try:
            infer_objective(module)
        except ValueError as error:
            unknown = ObjectiveUnknown(str(error), type(module).__name__)
            self._gave_up(unknown, None, self._unchecked())

    def _on_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
        """Check the window now, or, when ``step`` got a closure (Lightning runs the window's
        last micro-batch, its clipping and its callbacks inside ``step(closure)``), right after
        the closure returns, before the parameters move."""
        if self._done:
            return None
        return after_closure(args, kwargs, lambda: self._step_or_give_up(optimizer))

    def _step_or_give_up(self, optimizer: torch.optim.Optimizer) -> None:
        try:
            self._step(optimizer)
        except Exception as error:
            if error is self.failed or not self.keep_going:
                raise
            self._gave_up(error, optimizer, self._unchecked())

    # -- windows -----------------------------------------------------------------------------

    def _step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer`` is about to step: it joins the open window, or ends the window of the
        micro-batches recorded since (closing the open one first)."""
        if self._done:
            return
        last = self._last
        if last is not None and not self._capture.reached() and last.continues(optimizer):
            return  # the engine steps the window's other parameter groups (DeepSpeed ZeRO)
        if self._open is not None:
            stepped = any(o is optimizer for o in self._open.window.optimizers)
            if not stepped and not self._capture.reached():
                self._guarded(lambda: self._read(optimizer), optimizer)
                return
            self._close(optimizer)
            if self._done:
                return
        self._guarded(lambda: self._begin(optimizer), optimizer)

    def _paused(self, run: Any, optimizer: torch.optim.Optimizer | None, window: int = 0) -> Any:
        """``run()`` with recording paused; an error stops the probe from ``window`` (0: the
        window this ``step()`` checks) on (and, unless ``keep_going``, is raised: None is
        returned)."""
        self._capture.paused = True
        try:
            return run()
        except Exception as error:
            self._gave_up(error, optimizer, window)
            return None
        except BaseException as error:
            self.failed = error
            self._finish(optimizer)
            raise
        finally:
            self._capture.paused = False

    def _guarded(self, run: Any, optimizer: torch.optim.Optimizer) -> None:
        """Run a part of the check (paused); close the window once every parameter was read."""
        self._paused(run, optimizer)
        if self._open is not None and self._open.complete:
            self._close(optimizer)

    def _begin(self, optimizer: torch.optim.Optimizer) -> None:
        self._windows += 1
        calls, self._outer = self._capture.take()
        self._early.new_window()
        if self._padded(optimizer):
            return
        kept, left_out = micro_batches(calls)
        if callable(self.objective):  # forwards on one loop value: one micro-batch of fn's
            kept, _ = one_per_micro(kept)
        window = WindowData(self._windows, kept, [], self._leftovers, no_backward=left_out)
        self._leftovers = {}
        reader = self._reader(trained(optimizer), window, optimizer, extra=True)
        if reader is None:
            return
        self._open = OpenWindow.start(
            window, reader, sampler_for=self.sampler_for, objective=self.objective,
            ranks=self.ranks, engine=find_engine(), objective_source=self.objective_source,
            coupled=self.coupled,
        )  # fmt: skip
        self._open.read(optimizer, reader, self._clips_of(reader))

    def _padded(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the route stepping ran padding micro-batches in this window (said, and the
        probe stopped); every rank reads the same number, so every rank stops together."""
        engine = find_engine()
        count = getattr(engine.trainer_object, "fullbatch_padding", None)
        padding = count() if callable(count) else 0
        if not padding:
            return False
        self._problems.append(padded(engine.name, int(padding)))
        self._open = None
        self._finish(optimizer)
        return True

    def _read(self, optimizer: torch.optim.Optimizer) -> None:
        assert self._open is not None
        reader = self._reader(trained(optimizer), self._open.window, optimizer, extra=False)
        if reader is not None:
            self._open.read(optimizer, reader, self._clips_of(reader))

    def _clips_of(self, reader: AppliedGradient) -> list[Any]:
        return self._clips.for_step(reader.params()[: reader.stepped()], find_engine())

    def _reader(
        self, params: list[nn.Parameter], window: WindowData, optimizer: torch.optim.Optimizer,
        *, extra: bool,
    ) -> AppliedGradient | None:  # fmt: skip
        """The applied-gradient reader for the tensors ``optimizer`` steps (``params``: the
        model's parameters, or the flattened partitions an engine steps in their place), or
        None (said, and the probe stopped). ``extra``: the reference also differentiates the
        trainable parameters of the module that ran that no optimizer trains (the weight fit's,
        not compared)."""
        mine = window.calls_of(params)
        ran = mine or window.calls  # DeepSpeed ZeRO steps flat partitions of no module
        modules = tuple({id(c.module): c.module for c in ran}.values())
        others: list[nn.Parameter] = []
        if extra and mine:
            ids = {id(p) for p in params}
            others = [p for p in self.sampler_for(mine[0].module).params if id(p) not in ids]
        seen = Seen(tuple(params), modules, self._outer, tuple(others), ranks=self.ranks)
        reader = applied_gradient(seen)
        why = reader.unsupported() or reader.misread()  # decide, then read and check
        if why is None:
            self._last = reader
            return reader
        self._problems.append(unsupported(why))
        self._open = None
        self._finish(optimizer)
        return None

    def _close(self, optimizer: torch.optim.Optimizer | None = None, *, stopping: bool = True):
        """Measure the open window; after the last probed one, finish (and stop the run when
        asked to)."""
        assert self._open is not None
        open_window, self._open = self._open, None
        measured = self._paused(lambda: close(open_window), optimizer)
        if measured is None:
            return  # the probe failed and keeps going: it finished
        self._measured.append(measured)
        if self.limit is not None and len(self._measured) >= self.limit:
            self._finish(optimizer)
            if self.stop and stopping:
                raise ProbeFinished


def probe(
    model: nn.Module | None = None,
    optimizer: Any = None,
    *,
    objective: Any = None,
    windows: int | str | None = None,
    ranks: Any = None,
    coupled: bool = False,
) -> Probe:
    """Check that the code run inside the block accumulates gradients like the full batch.

    For each probed window (the micro-batches between two optimizer steps) the probe records
    every micro-batch the model ran (inputs, RNG state, autocast; a forward whose output reaches
    no backward is not one), and just before the parameters move recomputes the declared
    objective's gradient ``∇(Σ loss_sum) / Σ count`` over those micro-batches (and every
    data-parallel rank) with ``torch.autograd.grad``, compares it with the gradient each
    optimizer stepped at the window's end is about to apply (before a ``clip_grad_norm_``),
    and fits each micro-batch's weight in it to name what went wrong. Then every hook is
    removed and the run goes on unchanged: with or without the probe, parameters are bitwise
    equal on CPU.

    Args:
        model: the module to watch; default: the outermost module that runs with gradients
            (DDP and Lightning's wrappers looked through).
        optimizer: the optimizer whose steps end windows; default: every one that steps
            (several stepped together end one window, and all their parameters are checked).
        objective: ``"causal_lm"``, ``"token"``, ``"sample"``, ``"causal_lm+moe"`` (a
            transformers MoE model's cross-entropy plus its load balancing over the window;
            inferred for one whose forward adds it: docs/moe.md), ``fn(model, micro) ->
            (loss_sum, count)`` (``micro``: the engine's micro-batch, e.g. the Trainer's
            ``inputs``), or None to infer it from a Hugging Face head.
        windows: how many windows to check: a positive int; None, the first two (a gradient
            left over by a missing ``zero_grad()`` shows only in the second); ``"all"``,
            every window until the block ends.
        ranks: None (inferred: a tensor-parallel model's data dims, FSDP2's mesh; the DDP
            wrapper's group; else the default group), ``"local"``, or a process group.
        coupled: True declares that the callable ``objective`` couples rows (in-batch
            negatives, a batch statistic): each window is then compared with ``fn`` over its
            whole rows as one batch (its micro-batches concatenated, as
            ``window.run_coupled`` defines the full batch), on one process with gradients in
            ``.grad``; a per-micro-batch InfoNCE is wrong (``"coupled loss taken per
            micro-batch"``). Undeclared, a coupled loss is named, not judged.

    Returns:
        a :class:`Probe`; after the block, ``probe.report`` (``.ok``, ``.windows``; its text
        says which windows were checked).

    Raises:
        ValueError: bad arguments (``windows`` anything but a positive int, None or "all");
            at the model's first forward (before any backward), an objective that cannot be
            inferred (:class:`ObjectiveUnknown`); at the first step, one that cannot be
            computed (e.g. no labels), naming the choices.

    >>> import torch, fullbatch as fb
    >>> model = torch.nn.Linear(3, 4)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> micro_batches = [{"x": torch.randn(n, 3), "labels": torch.randint(4, (n,))}
    ...     for n in (1, 3)]
    >>> objective = lambda m, micro: fb.cross_entropy_sum(m(micro["x"]), micro["labels"])
    >>> with fb.probe(objective=objective) as probe:
    ...     for micro in micro_batches:     # a per-micro-batch mean divided by K: wrong
    ...         loss = torch.nn.functional.cross_entropy(model(micro["x"]), micro["labels"])
    ...         (loss / 2).backward()
    ...     opt.step()
    >>> probe.report.ok, probe.report.windows[0].pattern
    (False, 'mean of per-micro-batch means')
    """
    return Probe(
        model, optimizer, objective=objective, windows=windows, ranks=ranks, coupled=coupled
    )

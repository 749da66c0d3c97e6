"""``fb.probe``: check the accumulation of any training code, unchanged, while it runs."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as module_hooks
from torch.optim import optimizer as optimizer_hooks
from torch.utils.hooks import RemovableHandle

from fullbatch._probe._applied import AppliedGradient, Seen, applied_gradient
from fullbatch._probe._capture import Capture
from fullbatch._probe._clip import Clip, ClipObserver
from fullbatch._probe._engines import find_engine
from fullbatch._probe._judge import judge
from fullbatch._probe._measured import Measured
from fullbatch._probe._report import ProbeReport, WindowCheck
from fullbatch._probe._sample import Sampler
from fullbatch._probe._window import WindowData, measure
from fullbatch._proof._objective import check_objective

__all__ = ["Probe", "ProbeFinished", "probe"]


class ProbeFinished(BaseException):
    """Raised out of ``step()`` after the probed windows when the probe was asked to stop the
    run (``fullbatch probe`` without ``--keep-training``); a BaseException so that a script's
    ``except Exception`` does not swallow it."""


def _inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside Accelerate's or Lightning's wrapper."""
    for _ in range(4):
        inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            break
        optimizer = inner
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"optimizer must be a torch.optim.Optimizer (or a wrapper holding one), got "
            f"{type(optimizer).__name__}; or leave it out: fb.probe() finds the optimizers that "
            "step inside the block."
        )
    return optimizer


class Probe:
    """What ``fb.probe(...)`` returns: a context manager; ``report`` says what it found."""

    def __init__(
        self,
        model: nn.Module | None,
        optimizer: Any,
        *,
        objective: Any,
        windows: int,
        ranks: Any,
        stop: bool = False,
    ) -> None:
        if model is not None and not isinstance(model, nn.Module):
            raise ValueError(f"model must be an nn.Module or None, got {type(model).__name__}.")
        if isinstance(windows, bool) or not isinstance(windows, int) or windows < 1:
            raise ValueError(f"windows must be a positive int, got {windows!r}; e.g. windows=1.")
        if isinstance(ranks, str) and ranks != "local":
            raise ValueError(f"ranks={ranks!r}: pass None, 'local' or a process group.")
        check_objective(objective)
        self.optimizer = None if optimizer is None else _inner_optimizer(optimizer)
        self.objective, self.windows, self.ranks, self.stop = objective, windows, ranks, stop
        self._capture = Capture(model, self._first_call)
        self._clips = ClipObserver()
        self._samplers: dict[int, Sampler] = {}
        self._leftovers: dict[int, torch.Tensor] = {}
        self._measured: list[Measured] = []
        self._problems: list[str] = []
        self._steps = 0
        self._done = False
        self._handles: list[RemovableHandle] = []
        self._read: AppliedGradient | None = None  # the last window's reader
        self.failed: BaseException | None = None  # what the probe's own check raised

    # -- the report --------------------------------------------------------------------------

    @property
    def report(self) -> ProbeReport:
        """Every window checked so far, and what kept the probe from checking."""
        k_max = max((len(m.counts) for m in self._measured), default=0)
        checks = []
        for m in self._measured:
            verdict = judge(m, k_max)
            checks.append(
                WindowCheck(
                    step=m.step,
                    ok=verdict.ok,
                    error=m.error,
                    band=m.band,
                    tolerance=m.tolerance,
                    micro_batches=len(m.counts),
                    count=m.count,
                    weights=m.fit.weights,
                    leftover=m.fit.leftover,
                    diagnosis=verdict.sentence,
                    pattern=verdict.pattern,
                    engine=m.engine.name,
                    objective=m.objective,
                    ranks=m.ranks,
                    clip=m.clip,
                    precision=m.fit.stderr,
                    factor=m.fit.factor,
                    factor_precision=m.fit.factor_stderr,
                )
            )
        problems = list(self._problems)
        if not checks and not problems:
            problems.append(
                "nothing to check: no optimizer step was seen inside the block (the training "
                "ended before its first step, or its optimizer is not a torch.optim.Optimizer)"
            )
        engines = {m.engine.name for m in self._measured}
        return ProbeReport(tuple(checks), tuple(problems), ", ".join(sorted(engines)))

    # -- hooks -------------------------------------------------------------------------------

    def __enter__(self) -> Probe:
        self._capture.start()
        self._clips.start()
        if self.optimizer is None:
            self._handles.append(optimizer_hooks.register_optimizer_step_pre_hook(self._on_step))
        else:
            self._handles.append(self.optimizer.register_step_pre_hook(self._on_step))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._finish()
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _finish(self) -> None:
        """Stop recording; the step hook goes at the next forward (it cannot remove itself
        while ``step()`` iterates over the hooks) or at the block's end."""
        if self._done:
            return
        self._done = True
        self._capture.stop()
        self._clips.stop()

        def remove_step_hook(module: nn.Module, args: Any) -> None:
            for handle in self._handles:
                handle.remove()
            self._handles = []

        self._handles.append(module_hooks.register_module_forward_pre_hook(remove_step_hook))

    def sampler_for(self, module: nn.Module) -> Sampler:
        sampler = self._samplers.get(id(module))
        if sampler is None:
            sampler = Sampler([p for p in module.parameters() if p.requires_grad])
            self._samplers[id(module)] = sampler
        return sampler

    def _first_call(self, module: nn.Module, wrappers: tuple[nn.Module, ...]) -> None:
        """The window's first forward of ``module``: keep what gradient it already holds."""
        sampler = self.sampler_for(module)
        reader = applied_gradient(Seen(tuple(sampler.params), (module,), wrappers))
        if reader.unsupported() is not None:
            return
        grads = reader.leftover()
        if any(g is not None for g in grads):
            self._leftovers[id(module)] = sampler.take(grads)

    def _on_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
        """Check the window now, or, when ``step`` got a closure (Lightning runs the window's
        last micro-batch, its clipping and its callbacks inside ``step(closure)``), right after
        the closure returns, before the parameters move."""
        if self._done:
            return None
        closure = kwargs.get("closure", args[0] if args else None)
        if not callable(closure):
            self._check(optimizer)
            return None
        checked = False

        def closure_then_check() -> Any:
            nonlocal checked
            result = closure()
            if not checked:  # LBFGS calls its closure again: the window is the first call's
                checked = True
                self._check(optimizer)
            return result

        if "closure" in kwargs:
            return args, {**kwargs, "closure": closure_then_check}
        return (closure_then_check, *args[1:]), kwargs

    def _check(self, optimizer: torch.optim.Optimizer) -> None:
        if self._done:
            return
        calls, outer = self._capture.take()
        if not calls and self._read is not None and self._read.continues(optimizer):
            return  # the engine steps the window's other parameter groups (DeepSpeed ZeRO)
        self._steps += 1
        window = WindowData(self._steps, calls, [optimizer], self._leftovers)
        self._leftovers = {}
        params = window.params
        window.clips = self._clips.take({id(p) for p in params})
        engine = find_engine()
        if engine.clip is not None:  # clipped by the engine's own multiply: as it published
            max_norm, total, coef = engine.clip
            window.clips.append(Clip(frozenset(id(p) for p in params), max_norm, total, coef))
        reader = self._read = applied_gradient(self._seen(window, outer))
        why = reader.unsupported()
        if why is not None:
            self._problems.append(
                f"unsupported: {why}; the probe reads the gradient the optimizer applies "
                "through one reader per engine (.grad: plain loops, DDP, the Hugging Face "
                "Trainer, TRL, Lightning, Accelerate; DeepSpeed ZeRO 0-3 with or without "
                "offload; FSDP2 and HSDP)"
            )
            self._finish()
            return
        self._capture.paused = True
        try:
            measured = measure(
                window, reader, sampler_for=self.sampler_for, objective=self.objective,
                ranks=self.ranks, engine=engine,
            )  # fmt: skip
        except BaseException as error:
            self.failed = error
            self._finish()
            raise
        finally:
            self._capture.paused = False
        self._measured.append(measured)
        if len(self._measured) >= self.windows:
            self._finish()
            if self.stop:
                raise ProbeFinished

    def _seen(self, window: WindowData, outer: tuple[nn.Module, ...]) -> Seen:
        """The window's parameters (every optimizer's, then those of the module that ran that
        no optimizer trains), the modules that ran and the wrappers seen."""
        params = window.params
        mine = window.calls_of(params)
        ids = {id(p) for p in params}
        sampled = self.sampler_for(mine[0].module).params if mine else []
        extra = [p for p in sampled if id(p) not in ids]
        modules = tuple({id(c.module): c.module for c in mine}.values())
        return Seen(tuple(params), modules, outer, tuple(extra))


def probe(
    model: nn.Module | None = None,
    optimizer: Any = None,
    *,
    objective: Any = None,
    windows: int = 1,
    ranks: Any = None,
) -> Probe:
    """Check that the code run inside the block accumulates gradients like the full batch.

    For each of the first ``windows`` optimizer steps, the probe records every micro-batch the
    model ran since the previous step (inputs, RNG state, autocast), and just before ``step()``
    recomputes the declared objective's gradient ``∇(Σ loss_sum) / Σ count`` over those
    micro-batches (and every data-parallel rank) with ``torch.autograd.grad``, compares it with
    the gradient the optimizer is about to apply (before a ``clip_grad_norm_``), and fits each
    micro-batch's weight in it to name what went wrong. Then every hook is removed and the run
    goes on unchanged: with or without the probe, parameters are bitwise equal on CPU.

    Args:
        model: the module to watch; default: the outermost module that runs with gradients
            (DDP and Lightning's wrappers looked through).
        optimizer: the optimizer whose steps end windows; default: any that steps.
        objective: ``"causal_lm"``, ``"token"``, ``"sample"``, ``fn(model, micro) ->
            (loss_sum, count)`` (``micro``: the engine's micro-batch, e.g. the Trainer's
            ``inputs``), or None to infer it from a Hugging Face head.
        windows: how many windows to check.
        ranks: None (the DDP wrapper's group, else the default group), ``"local"``, or a
            process group.

    Returns:
        a :class:`Probe`; after the block, ``probe.report`` (``.ok``, ``.windows``).

    Raises:
        ValueError: bad arguments; at the first step, an objective that cannot be inferred or
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
    return Probe(model, optimizer, objective=objective, windows=windows, ranks=ranks)

"""One window, opened at its first optimizer's ``step()`` and read at every optimizer's.

A window is what the optimizers stepped between two micro-batches apply, so it may end with
several ``step()`` calls (a Muon + AdamW split, a body and a head optimizer). At the first one,
before any parameter moves, :meth:`OpenWindow.start` recomputes the reference
(:mod:`fullbatch._probe._reference`) for every parameter that may be stepped: that optimizer's
and the trainable parameters of the module that ran. At each optimizer's ``step()``,
:meth:`OpenWindow.read` reads the gradient it is about to apply through the window's reader
(:mod:`fullbatch._probe._applied`), after that optimizer's own clip and unscaling, compares it
with the reference, keeps its sampled coordinates for the weight fit, and frees that part of
the reference. :mod:`fullbatch._probe._measure` closes the window over every rank.

Every rank runs the same collectives in the same order whatever it found (a rank whose
recompute failed says so in the header, and then every rank raises), so a failure never leaves
a rank waiting. The reference ``Σ_rk ∇S_rk / N`` is one gradient-sized buffer summed over the
ranks, freed part by part as the optimizers read it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fullbatch._base._sync._probe import probe_sync
from fullbatch._probe._applied import AppliedGradient
from fullbatch._probe._applied_grad import GradApplied
from fullbatch._probe._call_loss import resolve
from fullbatch._probe._capture import Call
from fullbatch._probe._clip import Clip
from fullbatch._probe._coupled import coupling
from fullbatch._probe._engines import Engine
from fullbatch._probe._moe_objective import MOE, MoeWindow, moe_kind, prepare, routed_of
from fullbatch._probe._reference import LocalReference, recompute, summed_over_ranks
from fullbatch._probe._sample import Sampler, whole_shape
from fullbatch._probe._whole import Whole, whole_window
from fullbatch._proof._norms import squared
from fullbatch._proof._objective import unwrapped

__all__ = ["OpenWindow", "Part", "WindowData", "trained"]


def trained(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    """The parameters ``optimizer`` updates (requires_grad), each once, in its order."""
    seen: dict[int, nn.Parameter] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                seen.setdefault(id(p), p)
    return list(seen.values())


@dataclass
class WindowData:
    """What the probe recorded for one window.

    Attributes:
        step: the window's number (1 for the first seen in the block).
        calls: its micro-batches (:func:`fullbatch._probe._capture.micro_batches`).
        optimizers: every optimizer stepped at the window's end, in order (their parameters
            are checked together: ``params`` is their union, each once).
        leftovers: per module, the sampled gradient present at its first forward.
        clips: the ``clip_grad_norm_`` calls of the window.
        no_backward: forwards with gradients left out: their output reached no backward.
    """

    step: int
    calls: list[Call]
    optimizers: list[torch.optim.Optimizer]
    leftovers: dict[int, torch.Tensor] = field(default_factory=dict)
    clips: list[Clip] = field(default_factory=list)
    no_backward: int = 0

    @property
    def params(self) -> list[nn.Parameter]:
        seen: dict[int, nn.Parameter] = {}
        for optimizer in self.optimizers:
            for p in trained(optimizer):
                seen.setdefault(id(p), p)
        return list(seen.values())

    def calls_of(self, params: list[nn.Parameter]) -> list[Call]:
        """The calls of a module that holds one of ``params``."""
        ids = {id(p) for p in params}
        return [c for c in self.calls if any(id(p) in ids for p in c.module.parameters())]


@dataclass
class Part:
    """One optimizer's read: its parameters compared, and this rank's sums over them.

    ``diff`` ``‖a − r‖²``, ``ref`` ``‖r‖²`` and ``applied`` ``‖a‖²`` (``r`` the reference
    clipped as the engine clipped these parameters, ``a`` the applied gradient); ``raw``
    ``‖Σ ∇S‖²`` before dividing by ``N`` (for this part's share of the band).
    """

    label: str
    ids: frozenset[int]
    diff: float = 0.0
    ref: float = 0.0
    applied: float = 0.0
    raw: float = 0.0


def _names(modules: list[nn.Module]) -> dict[int, str]:
    return {id(p): name for m in modules for name, p in m.named_parameters()}


def _label(index: int, optimizer: Any, params: list[nn.Parameter], names: dict[int, str]) -> str:
    shown = [names.get(id(p), f"a {tuple(p.shape)} parameter") for p in params[:4]]
    more = f" and {len(params) - 4} more" if len(params) > 4 else ""
    return f"optimizer {index} ({type(optimizer).__name__}: {', '.join(shown)}{more})"


def _source(objective: Any, said: str, calls: list[Call]) -> str:
    """Where the objective came from, for the report."""
    if objective is not None and said in ("", "declared"):
        return "declared"
    if said and said != "the model's head":
        return said
    head = type(unwrapped(calls[0].module)).__name__ if calls else "the model"
    return f"inferred from {head}"


def _units(name: str, calls: list[Call]) -> tuple[tuple[str, float], ...]:
    """Other units a ``"sample"`` loss may count in: a float target with ``d > 1`` values per
    row (every micro-batch alike) is also averaged over its ``d`` outputs by a mean-reduced
    ``mse_loss``: every weight ``1/d``."""
    if name != "sample" or not calls:
        return ()
    widths = set()
    for call in calls:
        labels, _ = call.labels()
        if labels is None or not labels.is_floating_point() or labels.dim() == 0:
            return ()
        widths.add(labels[0].numel() if labels.shape[0] else 0)
    d = widths.pop() if len(widths) == 1 else 0
    if d > 1:
        return ((f"elements: a mean over each row's {d} outputs too (mse_loss's default)", 1 / d),)
    return ()


@dataclass
class OpenWindow:
    """A window between its first optimizer's ``step()`` and its close (module docstring)."""

    window: WindowData
    engine: Engine
    objective: str
    sync: Any
    sampler: Sampler | None
    params: list[nn.Parameter]  # the reference's parameters
    ref: list[torch.Tensor | None]  # Σ_rk ∇S_rk, None once read
    header: torch.Tensor  # every rank's [k, Σ counts, m, failed, band, band count]
    rec: LocalReference | None
    names: dict[int, str]
    parts: list[Part] = field(default_factory=list)
    applied: torch.Tensor | None = None  # sampled applied gradient, as the optimizer applies it
    divisor: torch.Tensor | None = None  # per sampled coordinate: the clip coefficient
    dtypes: list[torch.dtype] = field(default_factory=list)  # of the applied gradients read
    judged_sq: float = 0.0  # ‖applied before any clip‖² over the parameters read
    clip_sq: dict[int, float] = field(default_factory=dict)  # per clip: ‖its input, right‖²
    clip_covered: dict[int, set[int]] = field(default_factory=dict)  # per clip: ids read
    setting: tuple[float, str] | None = None  # the engine's own clip setting
    units: tuple[tuple[str, float], ...] = ()  # other units the objective's loss may count in
    objective_source: str = ""
    refused: str | None = None  # why fullbatch's routes refuse the engine's configuration
    coupled: str | None = None  # why a callable objective cannot be judged per micro-batch
    whole: Whole | None = None  # a declared coupled objective: its reference over the window
    moe: MoeWindow | None = None  # a MoE window's routing and aux gradients (causal_lm+moe)
    _where: dict[int, int] = field(default_factory=dict)
    _spans: dict[int, tuple[int, int]] = field(default_factory=dict)

    @property
    def count(self) -> float:
        return float(self.header[:, 1].sum())

    @property
    def complete(self) -> bool:
        """Every parameter of the reference has been stepped: no other optimizer can join."""
        read = {i for part in self.parts for i in part.ids}
        return all(id(p) in read for p in self.params)

    @classmethod
    def start(
        cls,
        window: WindowData,
        reader: AppliedGradient,
        *,
        sampler_for: Callable[[nn.Module], Sampler],
        objective: Any,
        ranks: Any,
        engine: Engine,
        objective_source: str = "",
        coupled: bool = False,
    ) -> OpenWindow:
        """Recompute the reference for the first optimizer's ``reader.params()`` (the model's
        parameters it steps, then the module's other trainable ones) over the window's
        micro-batches and sum it over the ranks; raises on every rank when the objective fails
        on one of them. ``coupled``: the callable objective is declared coupled: the reference
        compared is its gradient over the whole window (:mod:`fullbatch._probe._whole`)."""
        candidates = reader.params()
        mine = window.calls_of(candidates)
        wrapper = next((c.wrapper for c in mine if c.wrapper is not None), None)
        sync = probe_sync(wrapper, ranks if ranks is not None else reader.ranks())
        name = objective if isinstance(objective, str) else "inferred"
        sampler = sampler_for(mine[0].module) if mine else None
        failure: BaseException | None = None
        rec: LocalReference | None = None
        whole: Whole | None = None
        # The coupling checks run the model again, on this rank alone: only where that fires no
        # engine's collectives and changes no engine state (one process, gradients in .grad).
        alone = sync.world == 1 and isinstance(reader, GradApplied)
        moe: MoeWindow | None = None
        if mine:
            assert sampler is not None
            try:
                name, fn = resolve(objective, mine[0].module)
                name = moe_kind(name, mine[0].module, declared=objective is not None)
                routed = routed_of(objective)  # a callable objective with the window's aux
                with reader.replaying():
                    if name == MOE or routed is not None:  # the window's routing first
                        wrt = reader.wrt()
                        targets = list(candidates) if wrt is None else wrt
                        fn, moe = prepare(mine, sync, sampler, candidates, targets, reader.whole,
                                          routed=routed)  # fmt: skip
                    rec = recompute(
                        mine, candidates, sampler, fn, wrt=reader.wrt(), whole=reader.whole
                    )
                    if coupled:
                        whole = whole_window(mine, candidates, sampler, fn, name=name, alone=alone)
                if moe is not None:  # the fit's columns: each call's cross-entropy alone
                    rec.samples = moe.cross_entropy(rec.samples)
            except (ValueError, TypeError, RuntimeError) as raised:
                failure = raised
        counts = rec.counts if rec is not None else []
        total = whole.count if whole is not None and whole.rec is not None else sum(counts)
        header = torch.tensor(
            [len(counts), total, sampler.size if sampler is not None else 0,
             failure is not None, rec.band if rec is not None else 0.0,
             rec.band_count if rec is not None else 0.0],
            dtype=torch.float64,
        )  # fmt: skip
        every = sync.all_gather(header)
        if bool(every[:, 3].any()):
            if failure is not None:
                raise failure
            bad = [r for r in range(sync.world) if every[r, 3]]
            raise RuntimeError(
                f"fb.probe could not recompute the window on rank(s) {bad}; see there."
            )
        compared = whole.rec if whole is not None and whole.rec is not None else rec
        ref = summed_over_ranks(compared, candidates, sync)  # Σ_rk ∇S_rk
        for done in {id(r): r for r in (rec, compared) if r is not None}.values():
            done.ref = []  # held by ref alone now: freed as the optimizers read it
        modules = list({id(c.module): c.module for c in mine}.values())
        out = cls(window, engine, name, sync, sampler, candidates, list(ref), every, rec,
                  _names(modules))  # fmt: skip
        out._where = {id(p): i for i, p in enumerate(candidates)}
        out.objective_source = _source(objective, objective_source, mine)
        out.moe = moe
        if moe is not None and (
            out.objective_source.startswith("inferred") or routed_of(objective)
        ):
            out.objective_source += (
                f" with its router aux loss (router_aux_loss_coef={moe.aux.coef:g}, top-"
                f"{moe.aux.top_k}: load balancing over the window)"
            )
        out.units = _units(name, mine)
        out.whole = whole if whole is not None and whole.rec is not None else None
        if whole is not None:
            out.coupled = whole.refusal
        elif callable(objective) and alone:
            out.coupled = coupling(objective, name, mine)
        if sampler is not None:
            out.applied = torch.zeros(sampler.size, dtype=torch.float64)
            out.divisor = torch.ones(sampler.size, dtype=torch.float64)
            start = 0
            for p, index in zip(sampler.params, sampler.index, strict=True):
                n = whole_shape(p).numel() if index is None else index.numel()
                out._spans[id(p)] = (start, start + n)
                start += n
        return out

    def read(self, optimizer: Any, reader: AppliedGradient, clips: list[Clip]) -> None:
        """Compare what ``optimizer`` is about to apply with the reference; ``clips``: every
        clip of the window so far (each multiplies the parameters it lists)."""
        self.window.optimizers.append(optimizer)
        stepped = reader.params()[: reader.stepped()]  # the model's, for what the engine steps
        grads = reader.applied()
        own = reader.clip()  # a clip the engine applied itself (DeepSpeed's gradient_clipping)
        self.setting = self.setting or reader.clip_setting()
        self.refused = self.refused or reader.refused()
        if own is not None:
            source = self.setting[1] if self.setting else f"{type(reader).name}'s own clip"
            clips = [*clips, Clip(frozenset(id(p) for p in stepped), *own, source)]
        self.window.clips.extend(clips)
        done = {i for part in self.parts for i in part.ids}
        mine = [p for p in stepped if id(p) in self._where and id(p) not in done]
        label = _label(len(self.window.optimizers), optimizer, mine, self.names)
        part = Part(label, frozenset(id(p) for p in mine))
        self.parts.append(part)
        by_id = {id(p): g for p, g in zip(reader.params(), grads, strict=True)}
        self.dtypes += [g.dtype for g in grads if g is not None]
        count = self.count
        for p in mine:
            i = self._where[id(p)]
            coef = math.prod(c.coef for c in self.window.clips if id(p) in c.params)
            raw, got = self.ref[i], by_id.get(id(p))
            self.ref[i] = None  # read: this part of the reference is freed
            scale = coef / count if count > 0 else 0.0
            part.diff += squared([raw], [got], scale=scale)
            part.ref += squared([raw], scale=scale)
            part.applied += squared([got])
            part.raw += squared([raw])
            self._clip_inputs(p, got)
        if self.sampler is None or self.applied is None or self.divisor is None:
            return
        fresh = [p for p in reader.params() if id(p) in self._spans]
        if self.parts[1:]:  # later optimizers: only their own parameters are read again
            fresh = [p for p in fresh if id(p) in part.ids]
        sampled = self.sampler.take([by_id.get(id(p)) for p in self.sampler.params])
        for p in fresh:
            lo, hi = self._spans[id(p)]
            coef = math.prod(c.coef for c in self.window.clips if id(p) in c.params)
            self.applied[lo:hi] = sampled[lo:hi]
            self.divisor[lo:hi] = coef

    def _clip_inputs(self, p: nn.Parameter, got: torch.Tensor | None) -> None:
        """Add ``p``'s applied gradient, unclipped, to the judged norm and to what each clip of
        ``p`` should have measured: the gradient before that clip and every later one."""
        applying = [(i, c.coef) for i, c in enumerate(self.window.clips) if id(p) in c.params]
        g2 = squared([got]) if got is not None else 0.0
        coefs = [coef for _, coef in applying]
        total = math.prod(coefs)
        if total > 0 and math.isfinite(total):
            self.judged_sq += g2 / total**2
        for n, (i, _) in enumerate(applying):
            later = math.prod(coefs[n:])
            if later > 0 and math.isfinite(later):
                self.clip_sq[i] = self.clip_sq.get(i, 0.0) + g2 / later**2
            self.clip_covered.setdefault(i, set()).add(id(p))

    def masks(self) -> list[torch.Tensor]:
        """Per part, which sampled coordinates belong to its parameters."""
        size = self.sampler.size if self.sampler is not None else 0
        out = []
        for part in self.parts:
            mask = torch.zeros(size, dtype=torch.bool)
            for i in part.ids:
                if i in self._spans:
                    lo, hi = self._spans[i]
                    mask[lo:hi] = True
            out.append(mask)
        return out

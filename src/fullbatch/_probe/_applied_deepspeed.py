"""The applied gradient of a DeepSpeed engine: ZeRO stages 0-3, with or without CPU offload.

The probe checks a window when the torch optimizer steps, which DeepSpeed does inside
``engine.step()`` after it has reduced the window's gradient over the data-parallel ranks and
scaled it (its ``1/gradient_accumulation_steps`` unless ``scale_wrt_gas=False``). What is where
at that moment, and how this reader makes it one whole gradient per model parameter, *as the
optimizer applies it* (after DeepSpeed's clip, which :meth:`DeepSpeedApplied.clip` reports so
the comparison is the one before it):

- **stage 0**: each parameter's ``.grad``, already clipped by ``gradient_clipping``. DeepSpeed
  keeps no norm before that clip, so a window it clipped is refused (said, never guessed);
  one whose gradient is below the clip is read as is.
- **ZeRO 1-3**: the torch optimizer steps DeepSpeed's flattened fp32 partitions one parameter
  group (sub-group at stage 3) at a time: :meth:`DeepSpeedApplied.continues` makes those
  steps one window. DeepSpeed has measured the whole gradient's norm and clipped the group it
  steps first; the other groups are still unclipped. Stage 1-2: the stepped group's
  fragments are read from its partition's ``.grad`` (DeepSpeed has released its own gradient
  lists for it), the others through DeepSpeed's per-parameter mapping
  (``get_full_hp_grad``); each is summed whole over the ranks. Stage 3: every parameter
  through ``get_fp32_grad_for_param`` (an all-gather of its partition); with offload it reads
  the buffer DeepSpeed clipped, without it a copy DeepSpeed did not clip. The unclipped ones
  are multiplied by DeepSpeed's own coefficient, computed as DeepSpeed computes it, and the
  result's norm is checked against the norm DeepSpeed measured (a reader that misread a
  DeepSpeed release says so instead of judging).

Every rank reads every parameter in the same order (each read is a collective). DeepSpeed
zeroes its buffers in ``engine.step()``, so a window never starts with a gradient
(:meth:`~fullbatch._probe._applied.Reader.leftover`: none). Offload to NVMe, DeepSpeed's
BF16 optimizer and pipeline engines are refused by name.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from fullbatch._base._deepspeed import is_deepspeed_engine
from fullbatch._probe._applied import Reader, Seen

__all__ = ["DeepSpeedApplied"]

#: How far the norm of the gradient read may be from the norm DeepSpeed measured (relative):
#: float32 sums in another order differ by ~1e-7; a group read unclipped differs by 1 - coef.
_NORM_AGREES = 1e-4


def _pause_leaf_hooks(zero: Any) -> list[tuple[dict[int, Any], int, Any]]:
    """Take ZeRO-3's backward hooks off its leaf modules (the blocks it gathers whole, such as
    a MoE layer's experts) for the replays: after each backward of such a module they reduce
    and zero its parameters' gradients and count the hooks of the engine's backward (which
    fails inside ``torch.autograd.grad``). Returns what to put back: ``(dict, key, hook)``."""
    out = []
    for handle in getattr(zero, "_leaf_module_hooks", []):
        hooks = handle.hooks_dict_ref()
        if hooks is not None and handle.id in hooks:
            out.append((hooks, handle.id, hooks.pop(handle.id)))
    return out


def _engine_of(seen: Seen) -> Any:
    return next((w for w in seen.wrappers if is_deepspeed_engine(w)), None)


def _coefficient(norm: Any, loss_scale: float, max_norm: float) -> Any:
    """DeepSpeed's ``1 / combined_scale`` (``unscale_and_clip_grads``), with the same operations
    on the same types, so that multiplying by it rounds as DeepSpeed's own multiply did."""
    if max_norm <= 0:
        return 1.0 / loss_scale
    clip = ((norm * loss_scale / loss_scale) + 1e-6) / max_norm
    clip = torch.clamp(clip, min=1.0) if isinstance(clip, torch.Tensor) else max(clip, 1.0)
    return 1.0 / (clip * loss_scale)


class DeepSpeedApplied(Reader):
    """The gradient a DeepSpeed engine's optimizer applies (see the module docstring)."""

    name: ClassVar[str] = "DeepSpeed"

    def __init__(self, seen: Seen) -> None:
        super().__init__(seen)
        self.engine = _engine_of(seen)
        self.stage = int(self.engine.zero_optimization_stage())
        self.zero: Any = self.engine.optimizer if self.stage > 0 else None
        self._trained = self._trained_params()
        ids = {id(p) for p in self._trained}
        extra = [p for m in seen.modules for p in m.parameters() if p.requires_grad]
        self._extra = list({id(p): p for p in extra if id(p) not in ids}.values())
        self._stepping = self._stepped_group()
        self._read: list[torch.Tensor | None] | None = None
        self._coef: Any = 1.0
        self._norm = math.nan
        self._steps_read = -1

    @classmethod
    def claims(cls, seen: Seen) -> bool:
        return _engine_of(seen) is not None

    # -- what DeepSpeed trains, and which group it is stepping -------------------------------

    def _groups(self) -> list[list[nn.Parameter]]:
        if self.stage == 0:
            return [list(g["params"]) for g in self.engine.optimizer.param_groups]
        if self.stage == 3:
            return [list(g) for g in self.zero.fp16_groups]
        return [list(g) for g in self.zero.bit16_groups]

    def _trained_params(self) -> list[nn.Parameter]:
        seen: dict[int, nn.Parameter] = {}
        for group in self._groups():
            for p in group:
                if p.requires_grad:
                    seen.setdefault(id(p), p)
        return list(seen.values())

    def _flats(self) -> list[torch.Tensor]:
        """DeepSpeed's fp32 partitions, one per group: what the torch optimizer steps."""
        if self.stage == 3:
            return list(self.zero.fp32_partitioned_groups_flat)
        return list(self.zero.single_partition_of_fp32_groups)

    def _stepped_group(self) -> int | None:
        """The group whose partition the torch optimizer is stepping now, or None (not at a
        ZeRO step: a forward, or stage 0)."""
        if self.zero is None:
            return None
        stepped = {id(p) for p in self.seen.params}
        return next((i for i, f in enumerate(self._flats()) if id(f) in stepped), None)

    # -- the protocol -------------------------------------------------------------------------

    def params(self) -> list[nn.Parameter]:
        return [*self._trained, *self._extra]

    def stepped(self) -> int:
        return len(self._trained)

    def unsupported(self) -> str | None:
        return self._refused()  # decided from the engine's configuration: nothing is read

    def misread(self) -> str | None:
        if self.stage > 0 and self._stepping is None:
            return None  # not at a ZeRO step: nothing to read
        grads = self._whole()  # the read (a collective at ZeRO 1-2)
        got = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads if g is not None))
        if self.stage == 0:
            max_norm = float(self.engine.gradient_clipping())
            if max_norm > 0 and got >= max_norm * (1 - _NORM_AGREES):
                return (
                    f"DeepSpeed clipped the gradient to gradient_clipping={max_norm:g} at ZeRO "
                    "stage 0, where it keeps no norm before its clip; probe with "
                    "gradient_clipping 0 or at ZeRO stage 1-3"
                )
            return None
        want = float(self._norm) * float(self._coef)
        if abs(got - want) > _NORM_AGREES * max(want, 1e-30):
            return (
                f"the gradient read from DeepSpeed {_version()} (norm {got:.6g}) is not the one "
                f"DeepSpeed measured (norm {want:.6g} after its clip): this DeepSpeed release "
                "keeps its ZeRO gradients where the probe does not look"
            )
        return None

    def applied(self) -> list[torch.Tensor | None]:
        return [*self._whole(), *(p.grad for p in self._extra)]

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        paused = _pause_leaf_hooks(self.zero) if self.stage == 3 else []
        try:
            yield
        finally:  # ZeRO-3: the replays gathered parameters DeepSpeed's step had released;
            for hooks, key, hook in paused:
                hooks[key] = hook
            if self.stage == 3:  # left gathered, its step's gather would skip them (stale)
                self.zero.parameter_offload.partition_all_parameters()

    def clip(self) -> tuple[float, float, float] | None:
        max_norm = float(self.engine.gradient_clipping())
        if self.stage == 0 or max_norm <= 0 or self._read is None:
            return None
        return max_norm, float(self._norm), float(self._coef)

    def clip_setting(self) -> tuple[float, str]:
        """``gradient_clipping`` as the engine runs it, and whether the config set it or left
        it to DeepSpeed's default (1.0 since DeepSpeed #8068, 0 before)."""
        config = getattr(getattr(self.engine, "_config", None), "_param_dict", None)
        value = float(self.engine.gradient_clipping())
        if isinstance(config, dict) and "gradient_clipping" not in config:
            return value, (
                f"DeepSpeed {_version()}'s default gradient_clipping={value:g} (the config "
                "leaves gradient_clipping out)"
            )
        return value, f"the DeepSpeed config's gradient_clipping={value:g}"

    def refused(self) -> str | None:
        """What :func:`fullbatch._wings._deepspeed.refusal` says of this engine (0.17.0's ZeRO-2
        offload keeps one backward's gradient: ``ExactEngine`` refuses it too)."""
        from fullbatch._base._deepspeed import refusal

        return refusal(
            stage=self.stage, offload=bool(self.engine.zero_use_cpu_optimizer()),
            micro_batches=int(self.engine.gradient_accumulation_steps()), version=_version(),
        )  # fmt: skip

    def continues(self, optimizer: torch.optim.Optimizer) -> bool:
        inner = getattr(self.zero, "optimizer", None)
        return (
            self._stepping is not None
            and optimizer is inner
            and int(self.engine.global_steps) == self._steps_read
        )

    # -- reading -------------------------------------------------------------------------------

    def _refused(self) -> str | None:
        if type(self.engine).__name__ != "DeepSpeedEngine":
            return f"DeepSpeed's {type(self.engine).__name__} (pipeline parallelism)"
        if self.stage == 0:
            if not isinstance(self.engine.optimizer, torch.optim.Optimizer):
                return (
                    f"DeepSpeed's {type(self.engine.optimizer).__name__} at ZeRO stage 0 "
                    "(fp16/bf16 keep their own gradient buffers); probe at ZeRO stage 1-3"
                )
            return None
        known = ("DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3")
        if type(self.zero).__name__ not in known:
            return f"DeepSpeed's {type(self.zero).__name__} at ZeRO stage {self.stage}"
        if getattr(self.zero, "swap_optimizer", False):
            return "DeepSpeed ZeRO-Infinity (optimizer state swapped to NVMe)"
        return None

    def _whole(self) -> list[torch.Tensor | None]:
        """The stepped parameters' whole gradients as the optimizer applies them (once)."""
        if self._read is not None:
            return self._read
        if self.stage == 0:
            self._read = [p.grad for p in self._trained]
            return self._read
        zero = self.zero
        self._norm = zero._global_grad_norm
        self._coef = _coefficient(self._norm, float(zero.loss_scale), float(zero.clip_grad))
        self._steps_read = int(self.engine.global_steps)
        offload = bool(getattr(zero, "offload_optimizer", False))
        out: list[torch.Tensor | None] = []
        if self.stage == 3:
            for p in self._trained:
                full = zero.get_fp32_grad_for_param(p)
                group = zero.grad_position[zero.get_param_id(p)][0]
                if not (offload and group == self._stepping):
                    full = full.mul_(self._coef)  # a buffer of its own (the all-gather's)
                out.append(full)
        else:
            where = {id(p): i for i, g in enumerate(zero.bit16_groups) for p in g}
            flat = self._flats()[self._stepping].grad if self._stepping is not None else None
            for p in self._trained:
                mapped: Any = p  # DeepSpeed gave it its fragment's mapping and methods
                if where[id(p)] == self._stepping and flat is not None:
                    out.append(_from_partition(mapped, flat))
                else:
                    out.append(mapped.get_full_hp_grad().mul_(self._coef))
        self._read = out
        return out


def _from_partition(p: Any, flat_grad: torch.Tensor) -> torch.Tensor:
    """``p``'s whole gradient from this rank's fragment of its group's flat partition gradient
    (ZeRO 1-2), summed over the data-parallel ranks (each holds its own fragment)."""
    from deepspeed import comm

    whole = torch.zeros(p.numel(), dtype=torch.float32, device=flat_grad.device)
    mapping = getattr(p, "_hp_mapping", None)
    if mapping is not None:
        hp, lp = mapping.hp_fragment_address, mapping.lp_fragment_address
        whole.narrow(0, lp.start, lp.numel).copy_(flat_grad.narrow(0, hp.start, hp.numel))
    comm.all_reduce(whole, group=p._dp_group)
    return whole.reshape(p.shape)


def _version() -> str:
    module = sys.modules.get("deepspeed")
    return str(getattr(module, "__version__", "?"))

"""Collective counting and held-gradient measurement for the 2-D mesh rank functions
(``_dist_scale``): patched ``torch.distributed`` functions counted by group, and the gradient
bytes FSDP2 holds between micro-batches."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch.distributed as dist
from torch import nn


class _Counter:
    """Counts reduce-scatters, all-reduces and all-gathers by group (patched dist functions)."""

    NAMES = ("reduce_scatter_single", "reduce_scatter_tensor", "all_reduce")
    GATHERS = ("all_gather_single", "all_gather_into_tensor")

    def __init__(self, groups: dict[str, Any]) -> None:
        self.groups = groups
        self.calls: Counter[str] = Counter()
        self.saved: dict[str, Any] = {}

    def _name(self, group: Any) -> str:
        if group is None or group == dist.group.WORLD:
            return "world"
        return next((k for k, g in self.groups.items() if g == group), "other")

    def __enter__(self) -> _Counter:
        for name in self.NAMES + self.GATHERS:
            real = getattr(dist, name, None)
            if real is None:
                continue
            self.saved[name] = real
            kind = "rs" if name.startswith("reduce_scatter") else name.split("_single")[0]
            kind = "ag" if name in self.GATHERS else kind
            kind = "ar" if name == "all_reduce" else kind

            def call(*args: Any, _real: Any = real, _kind: str = kind, **kwargs: Any) -> Any:
                self.calls[f"{_kind}:{self._name(kwargs.get('group'))}"] += 1
                return _real(*args, **kwargs)

            setattr(dist, name, call)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, real in self.saved.items():
            setattr(dist, name, real)

    def take(self) -> dict[str, int]:
        out = dict(self.calls)
        self.calls.clear()
        return out


def _held_grad_bytes(model: nn.Module) -> int:
    """Gradient bytes this rank holds between micro-batches (FSDP2 private state, 2.13)."""
    from torch.distributed.fsdp import FSDPModule

    total = 0
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in module._get_fsdp_state()._fsdp_param_groups:
            partial = getattr(group, "_partial_reduce_output", None)
            total += 0 if partial is None else partial.numel() * partial.element_size()
            for fp in group.fsdp_params:
                for t in (
                    fp.unsharded_accumulated_grad,
                    getattr(getattr(fp, "_unsharded_param", None), "grad", None),
                    fp.sharded_param.grad,
                ):
                    if t is not None:
                        local = t.to_local() if hasattr(t, "to_local") else t
                        total += local.numel() * local.element_size()
    return total

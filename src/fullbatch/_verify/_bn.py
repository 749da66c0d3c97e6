"""Which train-mode BatchNorm layers ``batchnorm="window"`` makes exact, for verify's diagnosis.

``batchnorm="window"`` recomputes running statistics over the whole window. That is exact only
for a BatchNorm layer whose input does not depend on another train-mode BatchNorm: downstream
layers see activations normalized with micro-batch statistics, which differ from the full
batch's. Which layers are fed by another one is read off the autograd graph of one forward:
a layer is *fed* when a BatchNorm backward node lies upstream of its input.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["batchnorm_feeds"]


def _has_batchnorm_upstream(node: Any, memo: dict[Any, bool]) -> bool:
    """Whether a BatchNorm backward node is ``node`` or lies upstream of it (iterative DFS)."""
    stack = [(node, False)]
    while stack:
        current, expanded = stack.pop()
        if current is None or current in memo:
            continue
        parents = [n for n, _ in getattr(current, "next_functions", ()) if n is not None]
        if expanded:
            own = "BatchNormBackward" in type(current).__name__
            memo[current] = own or any(memo.get(p, False) for p in parents)
            continue
        stack.append((current, True))
        stack += [(p, False) for p in parents if p not in memo]
    return memo.get(node, False)


def batchnorm_feeds(model: nn.Module, forward: Callable[[], Any]) -> tuple[list[str], list[str]]:
    """``(first, fed)``: train-mode BatchNorm layers not fed / fed by another train-mode one.

    ``forward()`` runs the model once (with gradients enabled, no backward); layers that did
    not run are left out. Running statistics move: the caller restores buffers.

    >>> model = torch.nn.Sequential(
    ...     torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 3),
    ...     torch.nn.BatchNorm1d(3)).train()
    >>> batchnorm_feeds(model, lambda: model(torch.randn(4, 2)))
    (['1'], ['3'])
    """
    memo: dict[Any, bool] = {}
    seen: dict[str, bool] = {}
    handles = []

    def hook(name: str) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def pre_hook(module: nn.Module, inputs: tuple[Any, ...]) -> None:
            x = inputs[0] if inputs else None
            grad_fn = x.grad_fn if isinstance(x, torch.Tensor) else None
            fed = grad_fn is not None and _has_batchnorm_upstream(grad_fn, memo)
            seen[name] = seen.get(name, False) or fed

        return pre_hook

    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training:
            handles.append(module.register_forward_pre_hook(hook(name or "<root>")))
    try:
        with torch.enable_grad():
            forward()
    finally:
        for handle in handles:
            handle.remove()
    return [n for n, fed in seen.items() if not fed], [n for n, fed in seen.items() if fed]

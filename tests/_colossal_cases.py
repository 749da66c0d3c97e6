"""Stand-ins for ColossalAI's Booster wrappers, and the rank functions that train through them.

ColossalAI pins an old torch, so CI cannot install it. These classes copy the structure of
ColossalAI 0.4's (``colossalai/interface/model.py``, ``interface/optimizer.py``,
``booster/plugin/torch_ddp_plugin.py``, ``booster/mixed_precision/fp16_torch.py``): the same
class names, the same ``__module__``, ``.module`` / ``.optim`` / ``.unwrap()``, and forwards and
steps that pass through. fullbatch recognises them by exactly that, never by importing
ColossalAI. ``benchmarks/seed_frameworks.py`` runs the real ColossalAI where it installs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import fullbatch as fb
from _dist_cases import make_model, make_optimizer, rank_data


class ModelWrapper(nn.Module):
    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def unwrap(self) -> nn.Module:
        inner = self.module
        return inner.unwrap() if isinstance(inner, ModelWrapper) else inner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


class TorchDDPModel(ModelWrapper):
    def __init__(self, module: nn.Module, **ddp_kwargs: Any) -> None:
        super().__init__(module)
        self.module = nn.parallel.DistributedDataParallel(module, **ddp_kwargs)

    def unwrap(self) -> nn.Module:
        return self.module.module  # type: ignore[return-value]


class LowLevelZeroModel(ModelWrapper):
    pass


class GeminiDDP(ModelWrapper):
    pass


class OptimizerWrapper:
    def __init__(self, optim: torch.optim.Optimizer) -> None:
        self.optim = optim

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optim.param_groups

    def step(self, *args: Any, **kwargs: Any) -> Any:
        return self.optim.step(*args, **kwargs)

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        self.optim.zero_grad(*args, **kwargs)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        loss.backward(**kwargs)

    def unwrap(self) -> torch.optim.Optimizer:
        return self.optim


class TorchAMPOptimizer(OptimizerWrapper):
    def __init__(self, optim: torch.optim.Optimizer) -> None:
        super().__init__(optim)
        self.scaler = torch.amp.GradScaler("cpu", enabled=False)


class LowLevelZeroOptimizer(OptimizerWrapper):
    pass


class GeminiOptimizer(OptimizerWrapper):
    pass


for _cls, _module in [
    (ModelWrapper, "colossalai.interface.model"),
    (TorchDDPModel, "colossalai.booster.plugin.torch_ddp_plugin"),
    (LowLevelZeroModel, "colossalai.booster.plugin.low_level_zero_plugin"),
    (GeminiDDP, "colossalai.zero.gemini.gemini_ddp"),
    (OptimizerWrapper, "colossalai.interface.optimizer"),
    (TorchAMPOptimizer, "colossalai.booster.mixed_precision.fp16_torch"),
    (LowLevelZeroOptimizer, "colossalai.zero.low_level.low_level_optim"),
    (GeminiOptimizer, "colossalai.zero.gemini.gemini_optimizer"),
]:
    _cls.__module__ = _module

LAYOUT = [[3, 2, 4], [1, 5]]  # micro-batches per rank and their rows: uneven, a partial window


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def boosted(rank: int, world: int, route: str) -> dict[str, Any]:
    """Train through ``TorchDDPPlugin``-style objects: two loss terms with their own
    denominators, one backward each per micro-batch (ColossalAI #5601's pattern).

    ``route``: ``"boosted"`` (the boosted model and optimizer, ColossalAI's natural route),
    ``"inner_optimizer"`` (the boosted model with ``optimizer.optim``: 16-18% off and ranks
    diverging before fullbatch unwrapped the model) or ``"by_hand"`` (``model.module``,
    ``optimizer.optim``). Returns the parameters after every step, fullbatch's warnings, and
    every collective counted per window: DDP bucket all-reduces (a comm hook on the DDP model
    inside) and the size of every ``torch.distributed.all_reduce``.
    """
    import warnings

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    model = TorchDDPModel(make_model())
    optimizer = OptimizerWrapper(make_optimizer(model.parameters()))
    calls: dict[str, Any] = {"buckets": 0, "all_reduce": []}

    def counting(state, bucket):  # type: ignore[no-untyped-def]  (DDP checks annotations)
        calls["buckets"] += 1
        return default_hooks.allreduce_hook(state, bucket)

    model.module.register_comm_hook(None, counting)
    real = dist.all_reduce

    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls["all_reduce"].append(tensor.numel())  # the gradient's size, or a few numbers
        return real(tensor, *args, **kwargs)

    dist.all_reduce = all_reduce
    given = {
        "boosted": (model, optimizer),
        "inner_optimizer": (model, optimizer.optim),
        "by_hand": (model.module, optimizer.optim),
    }[route]
    counts = {"tokens": lambda m: int((m["y"] != -100).sum()), "rows": lambda m: m["x"].shape[0]}
    snaps, per_window = [], []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            acc = fb.Accumulator(*given, micro_batches=2, counts=counts, ddp_sync="step")
            for window in acc.windows(rank_data(rank, LAYOUT)):
                totals = window.totals
                for micro in window:
                    out = model(micro["x"])  # always the boosted model, as ColossalAI users do
                    ce, _ = fb.cross_entropy_sum(out, micro["y"])
                    window.backward(ce / totals["tokens"], retain_graph=True)
                    window.backward(out.square().sum() / totals["rows"])
                window.step()
                snaps.append(_flat(model))
                per_window.append({"buckets": calls["buckets"], "all_reduce": calls["all_reduce"]})
                calls.update(buckets=0, all_reduce=[])
            acc.close()
    finally:
        dist.all_reduce = real
    return {
        "params": snaps,
        "calls": per_window,
        "acc_model_is_ddp": acc.model is model.module,
        "acc_optimizer_is_inner": acc.optimizer is optimizer.optim,
        "warnings": [str(w.message) for w in caught],
        "n_params": sum(p.numel() for p in model.parameters()),
    }


def one_down(rank: int, world: int, kind: str, inner: bool) -> list[str]:
    """Build an Accumulator on a user's wrapper whose ``.module`` is DDP or FSDP2
    (``inner=False``) or on that inner model (``inner=True``); return the warnings, the error
    (``"raised: ..."``) and, after an error, whether anything was left behind."""
    import warnings

    model = make_model()
    if kind == "ddp":
        wrapped: nn.Module = nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        wrapped = fully_shard(model)

    class Wrapper(nn.Module):  # e.g. a framework's model wrapper, not ColossalAI's
        def __init__(self) -> None:
            super().__init__()
            self.module = wrapped

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.module(x)

    outer = Wrapper()
    opt = make_optimizer(outer.parameters())
    before = [p.detach().clone() for p in outer.parameters()]
    out = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fb.Accumulator(outer.module if inner else outer, opt, micro_batches=2).close()
        except ValueError as error:
            out.append(f"raised: {error}")
            unchanged = all(
                torch.equal(p, q) for p, q in zip(outer.parameters(), before, strict=True)
            )
            out.append(f"unchanged: {unchanged and not opt._optimizer_step_pre_hooks}")
    return [str(w.message) for w in caught] + out

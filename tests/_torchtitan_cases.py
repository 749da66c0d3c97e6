"""Rank functions for torchtitan 0.3.0 on CPU (tests/probe/test_probe_torchtitan.py).

torchtitan's own pieces: its llama3 debug model (``llama3_debugmodel()``'s config, cut to
``LAYERS`` layers), ``ParallelDims`` and its meshes, ``parallelize_llama`` (TP 2 and FSDP2 2
with ``spmd_backend="partial_dtensor"``), FSDP2's division turned off as its trainer does
(``disable_fsdp_gradient_division``, inside ``apply_fsdp_to_decoder``) and its summed
cross-entropy (``components/loss.py: cross_entropy_loss``, vocab-parallel on the TP logits).

What is changed to run on CPU gloo, without editing torchtitan's files (each done here, in
this file, and only here):

- ``torchtitan.distributed.parallel_dims.device_type`` is set to ``"cpu"``
  (``tools/utils.py`` falls back to ``"cuda"`` when no accelerator is found: a monkeypatch);
- the inner attention is ``ScaledDotProductAttention`` (causal), built into the layer configs:
  flex attention has no CPU backward, and ``attn_backend="sdpa"`` is refused by name;
- ``mixed_precision_param="float32"`` and every FSDP module's
  ``set_force_sum_reduction_for_comms(True)`` (a public FSDP2 call): gloo has no
  ``PREMUL_SUM``, which FSDP2 uses for a divide factor of 1 in float32;
- the training loop is written here, the way ``Trainer.train_step`` normalizes (summed loss
  over ``global_valid_tokens``, the window's valid labels summed over its "batch" mesh before
  the first forward), not its Trainer (no train step of it runs on CPU).

Loops: ``"right"`` as above; ``"count over tp"``, the valid-token count summed over every rank
(the TP ranks' copies of the same tokens counted too).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import fullbatch as fb

LAYERS = 1
SEQ = 8
K = 3
VOCAB = 2048
#: rows of each data rank's micro-batches (one window of K)
ROWS = [[2, 1, 1], [1, 3, 1]]


def _config() -> Any:
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    cfg = llama3_debugmodel()
    cfg.parallelism.spmd_backend = "partial_dtensor"
    cfg.parallelism.data_parallel_shard_degree = 2
    cfg.parallelism.tensor_parallel_degree = 2
    cfg.training.mixed_precision_param = "float32"
    model = cfg.model_spec.model
    model.layers = model.layers[:LAYERS]
    for layer in model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return cfg


def build_model(cfg: Any) -> nn.Module:
    """torchtitan's llama3 (``cfg``'s), initialized by its own ``init_weights`` from seed 0."""
    torch.manual_seed(0)
    model = cfg.model_spec.model.build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def micro_batches(data_rank: int) -> list[dict[str, torch.Tensor]]:
    """The data rank's micro-batches: tokens and next-token labels, some ignored (-100)."""
    out = []
    for i, rows in enumerate(ROWS[data_rank]):
        g = torch.Generator().manual_seed(1000 * data_rank + i)
        seq = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
        labels = seq[:, 1:].clone()
        labels[torch.rand(rows, SEQ, generator=g) < 0.3] = -100
        out.append({"input": seq[:, :-1], "labels": labels})
    return out


def objective(model: nn.Module, micro: dict[str, torch.Tensor]) -> tuple[Any, Any]:
    from torchtitan.components.loss import cross_entropy_loss

    count = (micro["labels"] != -100).sum()
    return cross_entropy_loss(model(micro["input"]), micro["labels"]), count


def _record(into: list[Any], model: nn.Module, *hook_args: Any) -> None:
    if not into:
        into.append({n: _whole(p.grad) for n, p in model.named_parameters()})


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()


def _parallelized(cfg: Any, parallel_dims: Any) -> tuple[nn.Module, Any, list[Any]]:
    """torchtitan's model under its ``parallelize_llama``, an SGD optimizer, and the list
    that receives the gradient the optimizer applies (recorded at its first step)."""
    from torchtitan.models.llama3 import parallelize_llama

    model = parallelize_llama(
        build_model(cfg), parallel_dims=parallel_dims, training=cfg.training,
        parallelism=cfg.parallelism, compile_config=cfg.compile, ac_config=None,
        dump_folder="",
    )  # fmt: skip
    for module in model.modules():
        if hasattr(module, "set_force_sum_reduction_for_comms"):
            module.set_force_sum_reduction_for_comms(True)  # gloo: no PREMUL_SUM
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    applied: list[Any] = []
    opt.register_step_pre_hook(functools.partial(_record, applied, model))
    return model, opt, applied


def _accumulator(cfg: Any, parallel_dims: Any) -> dict[str, Any]:
    """The same model and data trained by ``fb.Accumulator`` (no argument about the mesh)."""
    model, opt, applied = _parallelized(cfg, parallel_dims)
    data = micro_batches(parallel_dims.get_mesh("batch").get_local_rank())
    with fb.Accumulator(model, opt, micro_batches=K) as acc:
        for window in acc.windows(data):
            for micro in window:
                window.backward(*objective(model, micro))
            stats = window.step()
    return {"applied": applied[0], "count": stats.count}


def _case(cfg: Any, parallel_dims: Any, how: str) -> dict[str, Any]:
    model, opt, applied = _parallelized(cfg, parallel_dims)
    batch = parallel_dims.get_mesh("batch")
    window = micro_batches(batch.get_local_rank())
    with fb.probe(objective=objective, windows=1) as probe:
        # torchtitan's train_step: valid tokens of the whole window, summed over "batch"
        local = sum((m["labels"] != -100).sum() for m in window)
        global_valid_tokens = local.clone()
        if how == "count over tp":
            dist.all_reduce(global_valid_tokens)  # every rank: the TP copies counted too
        else:
            dist.all_reduce(global_valid_tokens, group=batch.get_group())
        for micro in window:
            loss_sum, _ = objective(model, micro)
            (loss_sum / global_valid_tokens).backward()
        opt.step()
    return {"applied": applied[0], "report": probe.report}


def fsdp_tp(rank: int, world: int) -> dict[str, Any]:
    """torchtitan's FSDP 2 x TP 2 on 4 ranks: every loop, and ``fb.Accumulator``."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    parallel_dims_module.device_type = "cpu"  # monkeypatch: CPU, not torchtitan's "cuda"
    cfg = _config()
    dist_utils.set_spmd_backend(cfg.parallelism.spmd_backend)
    cfg.model_spec.model.update_from_config(config=cfg)
    parallel_dims = ParallelDims.from_config(cfg.parallelism, world)
    parallel_dims.build_mesh()
    out = {how: _case(cfg, parallel_dims, how) for how in ("right", "count over tp")}
    return {**out, "accumulator": _accumulator(cfg, parallel_dims)}


def reference() -> dict[str, torch.Tensor]:
    """The full batch's gradient (float64: the mean over every data rank's valid labels) of
    the same model, unparallelized, in plain PyTorch."""
    model = build_model(_config()).double()
    micros = [m for r in range(len(ROWS)) for m in micro_batches(r)]
    loss = sum(
        nn.functional.cross_entropy(
            model(m["input"]).flatten(0, 1), m["labels"].flatten(), reduction="sum"
        )
        for m in micros
    )
    count = sum(int((m["labels"] != -100).sum()) for m in micros)
    (loss / count).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}

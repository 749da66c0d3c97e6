"""``ExactTrainer`` under the Hugging Face Trainer's DeepSpeed integration: the scale up front.

With a DeepSpeed config, Accelerate's ``backward`` runs ``engine.backward`` and, on the
window's last micro-batch, ``engine.step()``: ZeRO 2/3 have reduced and partitioned each
gradient during backward, so no factor can be applied after the window. The exact route
therefore counts the window before its first forward (:func:`window_scale`: each micro-batch's
items from its labels, ``exact_count``, summed over the ranks) and backpropagates
``loss_sum · W / N`` with ``scale_wrt_gas=False`` (:func:`scaled`): DeepSpeed's ``1 / GA`` is
off and its average over ``W`` ranks undone. A non-finite loss, or a window without items,
gets a NaN scale, so DeepSpeed's overflow check skips the step (parameters, optimizer state
and LR schedule untouched). :func:`check_config` refuses, before training, what cannot be
exact: ZeRO stage 0 (DeepSpeed applies a non-finite gradient there), a clip that differs from
``max_grad_norm`` (a config without ``gradient_clipping`` clips at 1.0), and what
:func:`fullbatch.deepspeed.refusal` names.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["check_config", "check_counts", "scaled", "window_scale"]


def _config(args: Any) -> dict[str, Any]:
    hf = getattr(args, "hf_deepspeed_config", None)
    config = getattr(hf, "config", None)
    return config if isinstance(config, dict) else {}


def check_config(name: str, args: Any) -> None:
    """Raise ``ValueError`` for a DeepSpeed config ``name`` cannot make exact."""
    import deepspeed

    from fullbatch.deepspeed import refusal

    config = _config(args)
    zero = config.get("zero_optimization", {}) or {}
    stage = int(zero.get("stage", 0))
    offload = str((zero.get("offload_optimizer") or {}).get("device", "none")) in ("cpu", "nvme")
    clip = config.get("gradient_clipping", 1.0)  # DeepSpeed's default when the key is absent
    want = args.max_grad_norm or 0.0
    why = refusal(
        stage=stage,
        offload=offload,
        micro_batches=args.gradient_accumulation_steps,
        version=deepspeed.__version__,
    )
    if stage == 0:
        why = (
            "at ZeRO stage 0 DeepSpeed applies a non-finite gradient instead of skipping the "
            "window; use ZeRO stage 1-3, or DDP (torchrun, no deepspeed=)"
        )
    elif clip != "auto" and float(clip) != float(want):
        why = (
            f"the DeepSpeed config clips at gradient_clipping={clip}"
            f"{' (its default: the key is absent)' if 'gradient_clipping' not in config else ''}"
            f' while max_grad_norm={args.max_grad_norm}; set "gradient_clipping": "auto" '
            "in the config (it then follows max_grad_norm)"
        )
    if why is not None:
        raise ValueError(f"{name} cannot make this DeepSpeed step exact: {why}.")


def window_scale(counts: list[Any], reduce: Any, world: int, device: Any) -> tuple[float, float]:
    """``(N, W / N)`` for the window: ``counts`` (this rank's micro-batches) summed over the
    ranks by ``reduce`` (``None`` on one process); the scale is NaN when ``N = 0`` (DeepSpeed
    then skips the window).

    >>> window_scale([3, 5], None, 2, "cpu")
    (8.0, 0.25)
    """
    local = torch.tensor([float(sum(float(c) for c in counts))], dtype=torch.float64)
    total = local.to(device)
    if reduce is not None:
        total = reduce(total)
    n = float(total[0])
    return n, (world / n if n > 0 else math.nan)


def scaled(loss_sum: torch.Tensor, scale: float) -> torch.Tensor:
    """``loss_sum · scale``, or NaN times it when the loss is not finite (DeepSpeed skips)."""
    loss = loss_sum.detach()
    factor = torch.where(torch.isfinite(loss), scale, math.nan).to(loss_sum.dtype)
    return loss_sum * factor


def check_counts(name: str, got: list[float], counted: list[float]) -> None:
    """The loss's counts must be the window's up-front counts (they fixed the scale)."""
    if [float(g) for g in got] != [float(c) for c in counted]:
        raise ValueError(
            f"{name} under DeepSpeed scales each loss by the window's count read before the "
            f"forward (exact_count: {counted}), but the losses held {got} items. Override "
            "exact_count(inputs) to count exactly the items exact_loss sums."
        )

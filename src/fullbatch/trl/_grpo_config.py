"""What ``ExactGRPOTrainer`` refuses before anything is built, each with the reason and the fix.

Loss types without a full-batch form (``bnpo``) or that fullbatch does not make exact, a token
selection per micro-batch (``top_entropy_quantile < 1``), DeepSpeed ZeRO stage 0, and what every
Trainer wing refuses (``fullbatch.hf._settings``).
"""

from __future__ import annotations

from typing import Any

from fullbatch.hf._deepspeed import zero_stage
from fullbatch.hf._settings import refuse_args
from fullbatch.trl._grpo_window import EXACT_LOSSES

__all__ = ["check_config"]


def check_config(config: Any) -> None:
    """Refuse, before anything is built, what ExactGRPOTrainer cannot make exact."""
    loss_type = getattr(config, "loss_type", None)
    if loss_type == "bnpo":
        raise ValueError(
            "loss_type='bnpo' is defined by TRL as a mean of per-micro-batch token means, so "
            "it has no full-batch form: it changes with the micro-batch size. Its full-batch "
            "version is loss_type='dapo' (the window's summed per-token loss over its "
            "completion tokens); ExactGRPOTrainer refuses 'bnpo' rather than change the "
            "objective silently. Use GRPOConfig(loss_type='dapo')."
        )
    if loss_type not in EXACT_LOSSES:
        raise ValueError(
            f"ExactGRPOTrainer makes loss_type in {list(EXACT_LOSSES)} exact; got "
            f"loss_type={loss_type!r}. Use one of those, or trl.GRPOTrainer for this one."
        )
    quantile = getattr(config, "top_entropy_quantile", 1.0)
    if quantile < 1.0:
        raise ValueError(
            f"top_entropy_quantile={quantile} keeps the tokens above an entropy quantile of "
            "each micro-batch, so the selected tokens change with the micro-batch size: no "
            "window objective exists. Use top_entropy_quantile=1.0 with ExactGRPOTrainer."
        )
    refuse_args("ExactGRPOTrainer", config)  # DataParallel, FSDP1, LOMO, DeepSpeed's clip
    if getattr(config, "deepspeed", None) and zero_stage(config) == 0:
        raise ValueError(
            "ExactGRPOTrainer cannot make a DeepSpeed ZeRO stage 0 step exact: the engine steps "
            "inside TRL's backward (Accelerate's), and at stage 0 DeepSpeed applies whatever "
            "gradient the window holds, so a window that must be skipped (no completion token, "
            "a non-finite loss) would be applied. Use ZeRO stage 1-3, whose overflow check "
            "skips it, or DDP."
        )

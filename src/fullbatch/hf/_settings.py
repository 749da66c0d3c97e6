"""Trainer settings no fullbatch Trainer wing can make exact, refused before training.

One list, with the reason and the fix, for ``fullbatch.hf.ExactTrainer`` (checked when it is
built) and the TRL trainers (checked before TRL touches the model, ``fullbatch.trl._refuse``).
What they accept: one process, DDP, FSDP2 (``fsdp_config`` version 2; on a CPU machine
Accelerate runs it as DDP), DeepSpeed ZeRO 0-3 (:func:`fullbatch.hf._deepspeed.check_config`).
"""

from __future__ import annotations

from typing import Any

from fullbatch.hf._deepspeed import check_config

__all__ = ["refuse_args"]


def refuse_args(
    name: str, args: Any, *, compute_loss_func: Any = None, uncounted_loss: bool = False
) -> None:
    """Raise ``ValueError`` for the first setting of ``args`` that cannot be exact.

    ``args``: the ``TrainingArguments`` (or a TRL config; ``None``: nothing to check);
    ``uncounted_loss``: a ``loss=fn`` without an ``exact_count`` override (DeepSpeed needs the
    window's count before its forward).
    """
    if args is None:
        return

    def get(key: str, default: Any = None) -> Any:
        return getattr(args, key, default)

    optim = str(get("optim", ""))
    fsdp_version = (get("fsdp_plugin_args") or {}).get("fsdp_version", 2) if get("fsdp") else 2
    reasons = {
        "compute_loss_func": "fullbatch computes the loss sum and count itself; pass it as "
        "loss=fn(outputs, labels) -> (loss_sum, count), or override exact_loss(model, inputs) "
        "in a subclass"
        if compute_loss_func is not None
        else None,
        f"label_smoothing_factor={get('label_smoothing_factor', 0.0)}": "the smoothed loss "
        "would be a per-micro-batch mean; write it as loss=fn(outputs, labels) -> "
        "(loss_sum, count), or set it to 0"
        if get("label_smoothing_factor", 0.0)
        else None,
        f"n_gpu={get('n_gpu', 1)} (DataParallel)": "DataParallel averages the loss per GPU; "
        "launch one process per GPU (torchrun)"
        if get("n_gpu", 1) > 1
        else None,
        "deepspeed with loss=fn": "under DeepSpeed the window is counted before its forward; "
        "override exact_count(inputs) in a subclass to give the count"
        if get("deepspeed") and uncounted_loss
        else None,
        f"FSDP1 (fsdp_config version {fsdp_version})": "FSDP1 keeps flattened gradients "
        "fullbatch does not read; use FSDP2: fsdp_config={'version': 2} (the default)"
        if fsdp_version != 2
        else None,
        f"optim={optim}": "LOMO optimizers backpropagate themselves; use another optimizer"
        if "lomo" in optim.lower()
        else None,
    }
    for setting, why in reasons.items():
        if why is not None:
            raise ValueError(f"{name} normalizes the loss itself and refuses {setting}: {why}.")
    if get("deepspeed"):
        check_config(name, args)

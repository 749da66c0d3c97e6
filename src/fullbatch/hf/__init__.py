"""Exact gradient accumulation for the Hugging Face ``Trainer``, whatever the head does.

The stock ``Trainer(gradient_accumulation_steps=K)`` is exact only when the model's forward
consumes ``num_items_in_batch``; many heads drop it (BERT's take a per-micro-batch mean).
:class:`ExactTrainer` owns the loss instead: it computes each micro-batch's loss *sum* and
item count from the logits and the labels, backpropagates ``c · loss_sum`` and, after the
window's last backward, multiplies the gradients by ``W / (c · N)`` (``N`` over every
micro-batch and rank), so clipping, callbacks and the optimizer see the full-batch gradient; a
window with no items, a non-finite loss or gradient is skipped as ``fb.Accumulator`` skips it
(``trainer.fb_counters``). Loss kinds (``loss=``): ``"causal_lm"``, ``"token"``,
``"sample"``, ``"seq2seq"`` or ``fn(outputs, labels) -> (loss_sum, count)``; ``-100`` labels
are never counted (``"masked_lm"`` and ``"classification"``, earlier names, still work with a
``DeprecationWarning`` naming ``"token"`` and ``"sample"``). :func:`check_trainer` runs a
configured Trainer on copies, one window against the full batch. The whole story (DDP, FSDP2,
DeepSpeed, what is refused): docs/integrations.md ("Hugging Face Trainer"). On a transformers
MoE model with ``output_router_logits`` the load-balancing loss is the window's (docs/moe.md).

>>> import fullbatch.hf
>>> fullbatch.hf.ExactTrainer.__mro__[1].__name__
'Trainer'

Modules: ``_trainer`` (:class:`ExactTrainer`), ``_window`` (a Trainer window from
``get_batch_samples`` to its close), ``_deepspeed`` (the window under a DeepSpeed config),
``_settings`` (settings refused before training), ``_seq2seq`` (encoder-decoder heads),
``_moe`` (an MoE model's load-balancing loss over the window: the routing pre-pass, and the
hook that reads router logits a fused head does not return).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from fullbatch.hf._trainer import LOSS_KINDS, ExactTrainer, LossFn, target_count  # noqa: F401

if TYPE_CHECKING:
    from fullbatch._verify._hf_check import TrainerCheck, check_trainer

__all__ = ["LOSS_KINDS", "ExactTrainer", "LossFn", "TrainerCheck", "check_trainer"]


def __getattr__(name: str) -> Any:
    """``check_trainer`` and ``TrainerCheck`` on first use (PEP 562): the check's machinery
    (the Accumulator, the verify arms) is not imported by ``ExactTrainer`` users."""
    if name not in ("TrainerCheck", "check_trainer"):
        raise AttributeError(f"module 'fullbatch.hf' has no attribute {name!r}")
    value = getattr(importlib.import_module("fullbatch._verify._hf_check"), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value

"""Exact gradient accumulation for the Hugging Face ``Trainer``, whatever the head does.

The stock ``Trainer(gradient_accumulation_steps=K)`` is exact only when the model's forward
consumes ``num_items_in_batch``. Many heads accept ``**kwargs`` and drop it (BERT's masked-LM and
sequence-classification heads take a plain per-micro-batch mean), and the Trainer then believes
the loss is already scaled: the step gets roughly ``K`` times the full-batch gradient, with
micro-batches weighted equally instead of by their item counts. :class:`ExactTrainer` owns the
loss instead:

- it computes the loss *sum* and the item count of every micro-batch from the logits and the
  labels (the head's own loss is not computed: ``labels`` are withheld from the model);
- it backpropagates ``c · loss_sum``, with ``c`` one number identical on every rank (a power
  of two ``<= 1 / N`` of the previous window), and after the window's last backward (gradients
  already summed over micro-batches and averaged over DDP ranks) multiplies the gradients by
  ``W / (c · N)``, where ``N`` is the window's item count over all micro-batches and all ranks
  (one small all-reduce) and ``W`` the number of DDP ranks (FSDP2: its divide factor).
  Clipping, ``on_pre_optimizer_step`` callbacks and the optimizer therefore see the
  full-batch gradient. Under DeepSpeed (ZeRO 0-3), whose engine steps inside the last
  backward, the window is counted when it is read (:meth:`ExactTrainer.exact_count`) and each
  loss backpropagated as ``loss_sum · W / N`` (``fullbatch.hf._deepspeed``);
- a window with no counted items, a non-finite loss or a non-finite gradient is skipped, as
  ``fb.Accumulator`` skips it: parameters, optimizer state and the LR schedule stay as they
  were, a ``RuntimeWarning`` says so (at the 1st, 2nd, 4th, ... skip) and
  ``trainer.fb_counters`` counts optimizer steps and skipped windows (``state.global_step``
  counts both);
- the partial last window of an epoch is normalized by its own count;
- the logged training loss is the true loss of each window (loss sum over ``N``), averaged over
  the windows of the logging interval. ``num_items_in_batch``, ``model_accepts_loss_kwargs``
  and ``average_tokens_across_devices`` play no part.

Loss kinds (``loss=``), the declared objectives of ``fb.probe`` and ``fb.verify``:
``"causal_lm"`` (next-token, labels aligned with the inputs, shifted here; a batch's
``shift_labels`` are used as they are), ``"token"`` (token targets, no shift: masked LM and
token classification), ``"sample"`` (one label per row: an integer class, or a float target
under squared error), ``"seq2seq"`` (encoder-decoders such as T5 and BART: ``"token"`` on the
decoder targets, ``decoder_input_ids`` built from the labels as the model builds them), or a
function ``fn(outputs, labels) -> (loss_sum, count)``. ``-100`` labels are never counted.
(``"masked_lm"`` and ``"classification"``, the names of earlier releases, are refused with the
name to use.)

:func:`check_trainer` runs a configured Trainer on copies, one window accumulated against the
same rows as one full batch, and says whether its accumulation is exact.

>>> import fullbatch.hf
>>> fullbatch.hf.ExactTrainer.__mro__[1].__name__
'Trainer'

Modules: ``_trainer`` (:class:`ExactTrainer`), ``_window`` (a Trainer window from
``get_batch_samples`` to its close), ``_deepspeed`` (the window under a DeepSpeed config),
``_settings`` (settings refused before training), ``_seq2seq`` (encoder-decoder heads).
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

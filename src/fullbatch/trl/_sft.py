"""``ExactSFTTrainer``: ``trl.SFTTrainer`` whose accumulated steps equal the full-batch step.

TRL's own loss is ``Σ -log p / num_items_in_batch``, exact only when the Trainer counts the
window's tokens, which it does only for models that accept loss kwargs: Gemma 4
(``accepts_loss_kwargs = False``) gets a per-micro-batch mean divided by
``gradient_accumulation_steps``. Here the micro-batch's loss *sum* and target count come from
TRL's fused LM head (the same per-token log-probabilities, entropies and top-1 hits TRL uses),
and :class:`fullbatch.hf.ExactTrainer`'s window normalization divides by the window's count
over all micro-batches and DDP ranks. TRL's metrics (``entropy``, ``mean_token_accuracy``,
``num_tokens``) are summed over the window in the same all-reduce as the count.

On a transformers MoE model (TRL's ``router_aux_loss_coef``), the load-balancing loss is the
window's, as in ``ExactTrainer`` (one routing pre-pass: :mod:`fullbatch.hf._moe`); the fused
head does not return the router logits, so a forward hook on the backbone reads them.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from trl import SFTTrainer

from fullbatch._base._warn import warn
from fullbatch.hf._moe import router_logits_of
from fullbatch.hf._trainer import ExactTrainer, target_count
from fullbatch.trl._refuse import common
from fullbatch.trl._step import offloaded_training_step

__all__ = ["ExactSFTTrainer", "per_token_loss"]


def per_token_loss(log_probs: torch.Tensor, loss_type: str) -> torch.Tensor:
    """TRL's SFT loss per target token from its fused head's log-probabilities (zero where
    nothing is predicted): ``-log p`` (``"nll"``) or ``-p log p`` with ``p`` detached
    (``"dft"``). Also the probe's objective for a stock ``SFTTrainer`` with ``"dft"``."""
    per_token = -log_probs
    if loss_type == "dft":
        per_token = per_token * log_probs.exp().detach()
    return per_token


class ExactSFTTrainer(ExactTrainer, SFTTrainer):
    """A ``trl.SFTTrainer`` whose every optimizer step equals the full-batch step.

    Takes exactly ``SFTTrainer``'s arguments. Each step's loss is
    ``Σ ℓ_t / N_W`` over the window's target tokens (all micro-batches, all DDP ranks; the
    partial last window by its own count), ``ℓ_t = -log p_t`` (``loss_type="nll"``) or
    ``-p_t log p_t`` with ``p_t`` detached (``"dft"``). Kept and exact: prompt-completion
    (completion-only) and conversational (assistant-only) loss, packing (``"bfd"``,
    ``padding_free``; ``"wrapped"`` packs rows that attend to each other, as TRL documents),
    TRL's fused LM head and logged metrics (over the whole window), the logged loss (the
    window's true loss). On an MoE model with TRL's ``router_aux_loss_coef`` (the config's by
    default), the step adds ``coef`` times the load-balancing loss of the whole window (all
    micro-batches and ranks), the full batch's, not each micro-batch's (docs/moe.md); the
    logged ``aux_loss`` is the window's.

    Raises:
        ValueError: before anything changes, settings that cannot be exact, each with the
            reason: what :class:`fullbatch.hf.ExactTrainer` refuses (``compute_loss_func``,
            a DeepSpeed config that cannot be exact, FSDP1, LOMO, ...).

    Example (tiny Llama, character tokenizer; the check proves the step exact):

    >>> import tempfile, warnings
    >>> from datasets import Dataset
    >>> from trl import SFTConfig
    >>> from fullbatch.testing import tiny_causal_lm, char_tokenizer
    >>> import fullbatch.hf, fullbatch.trl
    >>> rows = Dataset.from_list([{"prompt": "ab" * (i + 1), "completion": "cd" * (3 - i % 3)}
    ...     for i in range(8)])
    >>> config = SFTConfig(tempfile.mkdtemp(), per_device_train_batch_size=2,
    ...     gradient_accumulation_steps=4, use_cpu=True, report_to=[], save_strategy="no")
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore")
    ...     trainer = fullbatch.trl.ExactSFTTrainer(model=tiny_causal_lm("llama"), args=config,
    ...         train_dataset=rows, processing_class=char_tokenizer())
    >>> fullbatch.hf.check_trainer(trainer).passed
    True
    """

    #: What this route is called, for ``fb.probe`` (a declaration: see
    #: ``fullbatch._probe._engines``).
    fullbatch_route = "fullbatch.trl.ExactSFTTrainer"
    _fb_adds_router_aux = True  # exact_loss adds the window's load-balancing term

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        common("ExactSFTTrainer", SFTTrainer.__init__, args, kwargs)
        super().__init__(*args, **kwargs)
        self._fb_stats: list[torch.Tensor] = []

    training_step = offloaded_training_step

    def exact_loss(self, model: torch.nn.Module, inputs: dict[str, Any]) -> tuple[Any, Any]:
        """TRL's per-token loss summed over the micro-batch's targets, and their count."""
        if "labels" not in inputs:
            raise ValueError(
                f"the micro-batch has no 'labels' (keys: {sorted(inputs)}); SFTTrainer's "
                "collators build them. A custom data_collator must return 'labels' (-100 where "
                "nothing is predicted)."
            )
        routing = self._fb_routing if model.training else None
        if routing is None:
            outputs = model(**{**inputs, "use_cache": False}, fused_lm_head=True)
        else:  # the fused head returns no router logits: read them off the backbone
            with router_logits_of(self.accelerator.unwrap_model(model)) as seen:
                outputs = model(
                    **{**inputs, "use_cache": False}, fused_lm_head=True, output_router_logits=True
                )
            if len(seen) != 1:
                raise ValueError(
                    f"the forward's backbone returned router_logits {len(seen)} times, expected "
                    "once; ExactSFTTrainer needs them for the window's load-balancing loss. Set "
                    "router_aux_loss_coef=0.0 to train without it."
                )
        # zero on ignored positions; loss_type: an SFTConfig's
        per_token = per_token_loss(outputs.log_probs, getattr(self.args, "loss_type", "nll"))
        mask = outputs.label_mask
        if "attention_mask" in inputs:
            tokens = inputs["attention_mask"].sum()
        elif "position_ids" in inputs:
            tokens = torch.tensor(inputs["position_ids"].size(1))
        else:
            raise ValueError("Expected 'attention_mask' or 'position_ids' in inputs.")
        entropy = outputs.entropy.detach().sum()
        self._fb_stats = [entropy, outputs.is_top1.sum(), tokens]
        loss_sum = per_token.sum()
        if routing is not None:
            aux = routing.term_of(seen[0], inputs.get("attention_mask"))
            loss_sum = loss_sum + aux.to(loss_sum.dtype)
            # this micro-batch's share of the window's load-balancing loss, for the log
            scale = routing.items * routing.aux.coef
            self._fb_stats.append(aux.detach() / scale if scale else aux.detach())
        return loss_sum, mask.sum()

    def exact_count(self, inputs: dict[str, Any]) -> Any:
        """What TRL's fused head counts, before the forward: the causal targets."""
        return target_count(inputs, "causal_lm")

    def exact_micro_stats(self) -> list[torch.Tensor]:
        stats, self._fb_stats = self._fb_stats, []
        return [s.detach().double().reshape(1).to(self.args.device) for s in stats]

    def exact_window_end(self, totals: list[float]) -> None:
        _, count, entropy, correct, tokens, *aux = totals
        routing = self._fb_routing
        if aux and routing is not None and routing.items != count:
            warn(  # e.g. prompt-learning PEFT, whose fused head counts a virtual token per row
                f"the window's routing pre-pass counted {routing.items:g} target tokens but the "
                f"fused head {count:g}: the load-balancing term was weighted by "
                f"{routing.items:g}/{count:g} of its share. Override exact_count(inputs) to "
                "count what the fused head counts, or set router_aux_loss_coef=0.0.",
                through=("transformers", "trl", "accelerate"),
            )
        metrics = self._metrics["train"]
        if aux:  # the window's load-balancing loss (TRL logs each micro-batch's)
            metrics["aux_loss"].append(aux[0])
        metrics["entropy"].append(entropy / count if count > 0 else 0.0)
        metrics["mean_token_accuracy"].append(correct / count if count > 0 else 0.0)
        self._total_train_tokens += int(tokens) // self._tp_size
        metrics["num_tokens"] = [self._total_train_tokens]


ExactSFTTrainer.__init__.__signature__ = inspect.signature(SFTTrainer.__init__)  # type: ignore[attr-defined]

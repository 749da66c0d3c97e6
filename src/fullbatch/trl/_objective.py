"""A TRL trainer's objective per micro-batch, ``(loss_sum, count)``, for ``fb.probe``.

The probe judges a stock TRL trainer's step against the full-window gradient of the objective
that trainer trains. For ``DPOTrainer`` that objective is TRL's own ``_compute_loss`` (the code
:class:`fullbatch.trl.ExactDPOTrainer` weights per micro-batch): its value on a micro-batch
times the micro-batch's pairs is the sum of the pair-level losses (``loss_type`` ``sigmoid``,
``hinge``, ``ipo``, ...), counted in pairs; ``["sft"]`` alone is the chosen tokens'
``-log p`` summed, counted in chosen tokens. ``SFTTrainer(loss_type="dft")``: ``-p log p``
(``p`` detached) summed over the target tokens of TRL's fused LM head, counted in those tokens
(:func:`fullbatch.trl._sft.per_token_loss`, what ``ExactSFTTrainer`` trains). TRL's DPO loss
runs on a stand-in for the trainer (:class:`_Quiet`) that keeps the metrics it appends, its
token count and its gathers to itself: the probe's evaluation logs nothing and talks to no
other rank.

What has no such form is refused with the reason (the probe says it, exit 2, before anything
trains): ``sft`` mixed with a pair-level loss (two counts in one loss), ``aot``/
``aot_unpaired`` (they sort a batch's pairs against each other), an enabled MoE router loss,
a subclass that overrides ``compute_loss``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import torch
from trl import DPOTrainer

from fullbatch.trl._refuse import _BATCH_COUPLED
from fullbatch.trl._sft import per_token_loss

__all__ = ["CannotJudge", "dpo_objective", "sft_objective"]

#: Keyword arguments of the policy's forward that are no part of TRL's ``inputs``.
_CALL_ONLY = ("labels", "use_cache", "fused_lm_head", "num_items_in_batch", "output_router_logits")


class CannotJudge(ValueError):
    """The trainer's objective has no per-micro-batch ``(loss_sum, count)`` form: the reason."""


class _LocalAccelerator:
    """The trainer's accelerator, whose gathers return this rank's tensor unchanged."""

    def __init__(self, accelerator: Any) -> None:
        self._accelerator = accelerator

    def gather(self, tensor: Any) -> Any:
        return tensor

    gather_for_metrics = gather

    def __getattr__(self, name: str) -> Any:
        return getattr(self._accelerator, name)


class _Quiet:
    """The trainer as its loss code reads it; what that code writes (metrics, the token count)
    stays here, and its gathers are local."""

    def __init__(self, trainer: Any) -> None:
        self._trainer = trainer
        self._metrics: Any = defaultdict(lambda: defaultdict(list))
        self._total_train_tokens = 0
        self.accelerator = _LocalAccelerator(trainer.accelerator)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._trainer, name)


def _loss_types(trainer: Any) -> list[str]:
    types = getattr(trainer, "loss_types", None) or getattr(trainer.args, "loss_type", None)
    types = types or ["sigmoid"]
    return [types] if isinstance(types, str) else list(types)


def _overrides(trainer: Any) -> str | None:
    """The class that overrides TRL's DPO loss, if any (fullbatch's own route excepted)."""
    for cls in type(trainer).__mro__:
        if cls is DPOTrainer:
            return None
        if cls.__module__.startswith("fullbatch."):
            continue
        if "compute_loss" in cls.__dict__ or "_compute_loss" in cls.__dict__:
            return cls.__name__
    return None


def _inputs(micro: Any, trainer: Any) -> dict[str, Any]:
    """TRL's ``inputs`` of the micro-batch: the trainer's own dict where the probe found it,
    else rebuilt from the policy's keyword inputs (``completion_mask``: the labels TRL masked)."""
    if isinstance(micro, Mapping) and "completion_mask" in micro:
        return dict(micro)
    if not isinstance(micro, Mapping) or not isinstance(micro.get("labels"), torch.Tensor):
        raise CannotJudge(
            "the probe did not find DPOTrainer's micro-batch (its inputs with completion_mask) "
            "nor the labels its forward received"
        )
    if getattr(trainer, "precompute_ref_logps", False):
        raise CannotJudge(
            "precompute_ref_log_probs=True keeps the reference log-probabilities in the "
            "trainer's micro-batch, which the probe did not find"
        )
    inputs = {k: v for k, v in micro.items() if k not in _CALL_ONLY}
    inputs["completion_mask"] = (micro["labels"] != -100).long()
    return inputs


def dpo_objective(trainer: Any) -> tuple[Callable[[torch.nn.Module, Any], Any], str]:
    """``(fn(model, micro) -> (loss_sum, count), what it is)`` for a ``trl.DPOTrainer``.

    Raises:
        CannotJudge: the trainer's loss has no per-micro-batch sum form (module docstring).
    """
    types = _loss_types(trainer)
    coupled = sorted(set(types) & _BATCH_COUPLED)
    if coupled:
        raise CannotJudge(
            f"loss_type={coupled} sorts the pairs of a batch against each other, so no sum over "
            "micro-batches is the full batch's loss"
        )
    if "sft" in types and len(types) > 1:
        raise CannotJudge(
            f"loss_type={types} mixes the 'sft' term (a mean over chosen tokens) with pair-level "
            "terms (means over pairs): two counts in one loss"
        )
    if getattr(trainer, "aux_loss_enabled", False):
        raise CannotJudge(
            "the MoE router auxiliary loss is a statistic of each micro-batch's routing"
        )
    owner = _overrides(trainer)
    if owner is not None:
        raise CannotJudge(f"{owner} overrides compute_loss")
    in_tokens = types == ["sft"]
    quiet = _Quiet(trainer)

    def dpo(model: torch.nn.Module, micro: Any) -> tuple[torch.Tensor, float]:
        inputs = _inputs(micro, trainer)
        loss = DPOTrainer._compute_loss(quiet, model, inputs, False)  # type: ignore[arg-type]
        if in_tokens:
            count = float(inputs["completion_mask"][..., 1:].chunk(2, dim=0)[0].sum())
        else:
            count = float(inputs["completion_mask"].shape[0] // 2)
        return loss * count, count

    dpo.paired_rows = True  # type: ignore[attr-defined]  # [chosen; rejected]: not reversed, not joined
    unit = "chosen tokens" if in_tokens else "pairs"
    return dpo, f"loss_type={types}, summed over {unit}"


def sft_objective(trainer: Any) -> tuple[Callable[[torch.nn.Module, Any], Any], str]:
    """``(fn(model, micro) -> (loss_sum, count), what it is)`` for a ``trl.SFTTrainer`` whose
    ``loss_type`` is not ``"nll"`` (that one is the built-in ``causal_lm``)."""
    loss_type = getattr(trainer.args, "loss_type", "nll") or "nll"

    def sft(model: torch.nn.Module, micro: Any) -> tuple[torch.Tensor, float]:
        if not isinstance(micro, Mapping) or not isinstance(micro.get("labels"), torch.Tensor):
            raise CannotJudge("the SFT micro-batch has no labels")
        inputs = {k: v for k, v in micro.items() if k not in _CALL_ONLY or k == "labels"}
        out = model(**inputs, use_cache=False, fused_lm_head=True)
        return per_token_loss(out.log_probs, loss_type).sum(), float(out.label_mask.sum())

    sft.__name__ = f"sft_{loss_type}"
    return sft, f"loss_type={loss_type!r}, summed over the target tokens"

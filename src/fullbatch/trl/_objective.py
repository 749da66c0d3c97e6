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

On a transformers MoE model with TRL's router aux loss on (``aux_loss_enabled``) the full batch
also trains ``router_aux_loss_coef · load_balancing`` over all the window's policy forwards
(what ``ExactDPOTrainer`` trains): the objective (``"dpo+moe"``) declares it with a
:class:`fullbatch._probe._moe_objective.Routed`, whose routing forward is TRL's policy forward
(:func:`fullbatch.trl._dpo.policy_inputs`); bound to the window's counts, each micro-batch's
loss is TRL's with its own aux term weighted by zero, plus ``N · coef · load_balancing(its
policy router logits, the window's counts)``, as ``ExactDPOTrainer.exact_loss`` adds it.

What has no such form is refused with the reason (the probe says it, exit 2, before anything
trains): ``sft`` mixed with a pair-level loss (two counts in one loss), ``aot``/
``aot_unpaired`` (they sort a batch's pairs against each other), an MoE router loss on a model
whose config names no experts per token, a subclass that overrides ``compute_loss``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import torch
from trl import DPOTrainer

from fullbatch._base._moe import MoeAux
from fullbatch._probe._moe_objective import Routed
from fullbatch.hf._moe import WindowRouting, router_logits_of
from fullbatch.trl._dpo import policy_inputs, policy_router_logits
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
    stays here, and its gathers are local. ``router_aux_loss_coef``: TRL's MoE coefficient
    as this stand-in has it (zero: TRL's per-micro-batch aux term weighted by zero)."""

    def __init__(self, trainer: Any, *, router_aux_loss_coef: float | None = None) -> None:
        self._trainer = trainer
        if router_aux_loss_coef is not None:
            self.router_aux_loss_coef = router_aux_loss_coef
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
    owner = _overrides(trainer)
    if owner is not None:
        raise CannotJudge(f"{owner} overrides compute_loss")
    in_tokens = types == ["sft"]
    unit = "chosen tokens" if in_tokens else "pairs"
    what = f"loss_type={types}, summed over {unit}"
    if getattr(trainer, "aux_loss_enabled", False):  # the coefficient: fb.probe says it
        return _unbound(_routed(trainer, in_tokens)), what
    quiet = _Quiet(trainer)

    def dpo(model: torch.nn.Module, micro: Any) -> tuple[torch.Tensor, float]:
        inputs = _inputs(micro, trainer)
        loss = DPOTrainer._compute_loss(quiet, model, inputs, False)  # type: ignore[arg-type]
        count = _count(inputs, in_tokens)
        return loss * count, count

    dpo.paired_rows = True  # type: ignore[attr-defined]  # [chosen; rejected]: not reversed, not joined
    return dpo, what


def _count(inputs: dict[str, Any], in_tokens: bool) -> float:
    """The micro-batch's count: its chosen completion tokens for ``["sft"]``, else its pairs."""
    if in_tokens:
        return float(inputs["completion_mask"][..., 1:].chunk(2, dim=0)[0].sum())
    return float(inputs["completion_mask"].shape[0] // 2)


def _routed(trainer: Any, in_tokens: bool) -> Routed:
    """TRL's DPO loss with the window's load balancing in place of each micro-batch's (module
    docstring): the routing pass, the count and the objective bound to the window."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    top_k = getattr(model.config.get_text_config(), "num_experts_per_tok", None)
    if not isinstance(top_k, int):
        raise CannotJudge(
            f"router_aux_loss_coef={trainer.router_aux_loss_coef} on {type(model).__name__}, "
            f"whose config names no experts per token (num_experts_per_tok={top_k!r}), so its "
            "load-balancing loss cannot be computed"
        )
    aux = lambda: MoeAux(float(trainer.router_aux_loss_coef), top_k)  # noqa: E731  # at the step
    quiet = _Quiet(trainer, router_aux_loss_coef=0.0)  # TRL's per-micro-batch aux term: 0

    def forward(module: torch.nn.Module, micro: Any) -> tuple[Any, Any, Any]:
        inputs = _inputs(micro, trainer)
        out = module(**policy_inputs(inputs), output_router_logits=True)
        return out.router_logits, inputs.get("attention_mask"), out

    def bind(counts: dict[str, torch.Tensor], items: float) -> Any:
        routing = WindowRouting(aux(), counts, items)

        def dpo_moe(module: torch.nn.Module, micro: Any) -> tuple[torch.Tensor, float]:
            inputs = _inputs(micro, trainer)
            with router_logits_of(trainer.accelerator.unwrap_model(module)) as seen:
                loss = DPOTrainer._compute_loss(quiet, module, inputs, False)  # type: ignore[arg-type]
            count = _count(inputs, in_tokens)
            term = routing.term_of(policy_router_logits(seen), inputs.get("attention_mask"))
            return loss * count + term.to(loss.dtype), count

        dpo_moe.paired_rows = True  # type: ignore[attr-defined]
        dpo_moe.__name__ = "dpo+moe"
        return dpo_moe

    return Routed(aux, forward, lambda micro: _count(_inputs(micro, trainer), in_tokens), bind)


def _unbound(routed: Routed) -> Callable[[torch.nn.Module, Any], Any]:
    """The objective as the probe receives it: it needs the window's routing counts, which the
    probe's pre-pass binds (``routed``); called unbound, it says so."""

    def unbound(model: torch.nn.Module, micro: Any) -> tuple[torch.Tensor, float]:
        raise CannotJudge(
            "the DPO objective with the MoE load balancing needs the window's routing counts "
            "(fb.probe's pre-pass binds them)"
        )

    unbound.paired_rows = True  # type: ignore[attr-defined]
    unbound.routed = routed  # type: ignore[attr-defined]
    unbound.__name__ = "dpo+moe"
    return unbound


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

"""``ExactDPOTrainer``: ``trl.DPOTrainer`` whose accumulated steps equal the full-batch step.

TRL's DPO loss is ``Σ_j w_j · mean(ℓ_j)`` per micro-batch, divided by
``gradient_accumulation_steps``: a pair-level term (``sigmoid``, ``hinge``, ``ipo``, ...) is the
mean over the micro-batch's pairs and the ``sft`` term (the RPO recipe) the mean over its
chosen tokens, so micro-batches of different sizes are weighted equally. Here the window's pair
and chosen-token counts (all micro-batches, all DDP ranks; one all-reduce) are read before its
first forward, and TRL's own loss runs on each micro-batch with the weights rescaled so that it
returns that micro-batch's share of the window loss ``Σ_j w_j Σ ℓ_j / N_j`` (``N_j``: the
window's pairs, or its chosen tokens for ``sft``). TRL's logged metrics are averaged over the
window with the same weights TRL uses within a micro-batch (pairs, or tokens).

On a transformers MoE model (TRL's ``router_aux_loss_coef``), TRL adds each micro-batch's
load-balancing loss (its policy forward on ``[chosen; rejected]``, ``attention_mask``
respected). Here it is the window's, as in ``ExactTrainer``: one routing pre-pass per window
(:mod:`fullbatch.hf._moe`) on the model inputs TRL's policy forward gets, each micro-batch's
term from the window's counts (its router logits read off the backbone, as in
``ExactSFTTrainer``), TRL's own term weighted by zero.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from trl import DPOTrainer

from fullbatch._base._moe import MoeAux
from fullbatch.hf import ExactTrainer
from fullbatch.hf._moe import WindowRouting, router_logits_of, window_routing
from fullbatch.hf._window import summed
from fullbatch.trl._refuse import common, dpo, reference
from fullbatch.trl._step import offloaded_training_step

__all__ = ["ExactDPOTrainer", "policy_inputs", "policy_router_logits"]

# Window counts per micro-batch: pairs, chosen tokens, rejected tokens.
_PAIRS, _CHOSEN, _REJECTED = 0, 1, 2
# The weight of each TRL metric: what TRL averages it over within one micro-batch.
_METRIC_WEIGHT = {
    "entropy": (_CHOSEN, _REJECTED),
    "logits/chosen": (_CHOSEN,),
    "logits/rejected": (_REJECTED,),
    "mean_token_accuracy": (_CHOSEN,),
}
# What TRL 1.16's DPO keeps out of the model's forward (``_compute_loss``).
_NOT_MODEL_INPUTS = ("completion_mask", "ref_chosen_logps", "ref_rejected_logps")


def policy_inputs(inputs: dict[str, Any]) -> dict[str, Any]:
    """The keyword inputs of TRL's policy forward on a micro-batch's ``[chosen; rejected]``, for
    a routing pass (no labels, no cache, one logit kept): this trainer's pre-pass and
    ``fb.probe``'s (:mod:`fullbatch.trl._objective`) alike."""
    given = {k: v for k, v in inputs.items() if k not in _NOT_MODEL_INPUTS}
    return {**given, "use_cache": False, "logits_to_keep": 1}


def policy_router_logits(seen: list[Any]) -> Any:
    """The policy forward's router logits among those ``router_logits_of`` saw in one call of
    TRL's DPO loss: TRL runs the policy first; the reference's forward (no gradient) follows
    through the same backbone only under PEFT without ``ref_model``."""
    reference = seen[1:2] and not any(t.requires_grad for t in seen[1])
    if not seen or len(seen) > 1 + bool(reference):
        raise ValueError(
            f"the micro-batch's forwards returned router_logits {len(seen)} times, expected "
            "once for the policy (and once more, without gradient, for a PEFT reference); "
            "the window's load-balancing loss needs them. Set router_aux_loss_coef=0.0 in the "
            "DPOConfig to train without it."
        )
    return seen[0]


class ExactDPOTrainer(ExactTrainer, DPOTrainer):
    """A ``trl.DPOTrainer`` whose every optimizer step equals the full-batch step.

    Takes exactly ``DPOTrainer``'s arguments. Each step minimizes
    ``Σ_j w_j · Σ_pairs ℓ_j / P_W`` over the window's ``P_W`` pairs (all micro-batches, all
    DDP ranks, the partial last window by its own count) for every pair-level ``loss_type``
    (``sigmoid``, ``hinge``, ``ipo``, ``exo_pair``, ``nca_pair``, ``robust``, ``bco_pair``,
    ``sppo_hard``, ``apo_zero``, ``apo_down``, ``discopop``, ``sigmoid_norm``; with
    ``f_divergence_type``, ``ld_alpha``, ``use_weighting``), and ``sft`` by the window's chosen
    tokens. TRL's logged rewards, log-probabilities, logits, entropy and token accuracy are
    those of the whole window; the logged loss is the window's loss. On an MoE model with TRL's
    ``router_aux_loss_coef`` (the config's by default), the step adds ``coef`` times the
    load-balancing loss of all the window's policy forwards (chosen and rejected, all
    micro-batches and ranks, padding left out): the full batch's, not each micro-batch's
    (docs/moe.md); the logged ``aux_loss`` is the window's.

    Raises:
        ValueError: before anything changes: ``aot``/``aot_unpaired`` (they sort the pairs of
            a batch against each other, so no per-micro-batch sum equals the full batch's),
            ``padding_free``, a model built from a config without ``ref_model=`` (TRL would
            reload the reference from its empty ``_name_or_path``; the message gives the
            fixes), and what :class:`fullbatch.trl.ExactSFTTrainer` refuses. In training, an
            MoE forward whose backbone does not return its router logits once.

    Example: see ``docs/integrations_trl.md``.

    >>> ExactDPOTrainer.__mro__[2].__name__
    'DPOTrainer'
    """

    #: What this route is called, for ``fb.probe`` (a declaration: see
    #: ``fullbatch._probe._engines``).
    fullbatch_route = "fullbatch.trl.ExactDPOTrainer"
    _fb_adds_router_aux = True  # exact_loss adds the window's load-balancing term

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        given = common("ExactDPOTrainer", DPOTrainer.__init__, args, kwargs)
        config = given.get("args")
        dpo(config)
        precompute = getattr(config, "precompute_ref_log_probs", False)
        if given.get("ref_model") is None and not precompute:
            reference(
                "ExactDPOTrainer",
                given.get("model"),
                given.get("peft_config"),
                "Pass the initial weights as the reference: ref_model=copy.deepcopy(model) "
                "(before training), or DPOConfig(..., precompute_ref_log_probs=True) (the "
                "reference log-probabilities are computed once, from the model before training), "
                "or model.save_pretrained(path) and model=path.",
            )
        super().__init__(*args, **kwargs)
        self._fb_counts = torch.zeros(0, 3)  # per micro-batch of the window, all ranks
        self._fb_local = torch.zeros(0, 3)  # this rank's
        self._fb_sums: dict[str, list[float]] = {}  # metric -> [weighted sum, weight]
        self._fb_aux: list[torch.Tensor] = []  # the micro-batch's share of the window's aux loss

    def get_batch_samples(
        self, epoch_iterator: Iterator[Any], num_batches: int, device: torch.device
    ) -> tuple[list[Any], None]:
        """Read the window and count its pairs and completion tokens over all ranks."""
        batches, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        rows = []
        for batch in batches:
            shifted = batch["completion_mask"][..., 1:]
            chosen, rejected = shifted.chunk(2, dim=0)
            rows.append([chosen.shape[0], float(chosen.sum()), float(rejected.sum())])
        local = torch.tensor(rows, dtype=torch.float64).reshape(-1, 3)
        counts = local.to(self.args.device)
        if self.accelerator.num_processes > 1:
            counts = self.accelerator.reduce(counts, reduction="sum")
        self._fb_local, self._fb_counts = local, counts.cpu()
        self._fb_sums = {}
        return batches, None

    def _window_routing(self, batches: list[Any]) -> WindowRouting | None:
        """TRL's aux loss (``aux_loss_enabled``: its coefficient, the config's experts per
        token) over the window: the routing pre-pass on the policy forward TRL runs (the
        model inputs of ``[chosen; rejected]``), counting pairs (``N``, as :meth:`exact_loss`)."""
        if not self.aux_loss_enabled or not batches:
            return None
        model = self.accelerator.unwrap_model(self.model)
        text = model.config.get_text_config()
        top_k = getattr(text, "num_experts_per_tok", None)
        if not isinstance(top_k, int):
            raise ValueError(
                f"ExactDPOTrainer: {type(model).__name__} has router_aux_loss_coef="
                f"{self.router_aux_loss_coef} but num_experts_per_tok={top_k!r}; the window's "
                "load-balancing loss needs the experts per token. Set router_aux_loss_coef=0.0 "
                "in the DPOConfig to train without it."
            )
        aux = MoeAux(float(self.router_aux_loss_coef), top_k)
        model.train()
        micro = [policy_inputs(self._prepare_inputs(batch)) for batch in batches]
        pairs = lambda inputs, outputs: inputs["input_ids"].shape[0] // 2  # noqa: E731
        return window_routing(aux, model, micro, pairs, summed(self))

    training_step = offloaded_training_step

    def exact_count(self, inputs: dict[str, Any]) -> Any:
        """The micro-batch's pairs (its count in :meth:`exact_loss`), before the forward."""
        return inputs["completion_mask"].shape[0] // 2

    def exact_loss(self, model: torch.nn.Module, inputs: dict[str, Any]) -> tuple[Any, Any]:
        """TRL's loss on this micro-batch, weighted to its share of the window's loss; returned
        times the window's pairs, with the micro-batch's pairs as its count."""
        k = self._fb_window.index if self._fb_window is not None else 0
        totals = self._fb_counts.sum(0)
        pairs, chosen = float(self._fb_local[k, _PAIRS]), float(self._fb_local[k, _CHOSEN])
        shares = [
            (chosen / float(totals[_CHOSEN]) if t == "sft" else pairs / float(totals[_PAIRS]))
            for t in self.loss_types
        ]
        weights, coef = self.loss_weights, self.router_aux_loss_coef
        routing = self._fb_routing if model.training else None
        metrics = self._metrics["train"]
        before = {key: len(v) for key, v in metrics.items()}
        self.loss_weights = [w * s for w, s in zip(weights, shares, strict=True)]
        if routing is not None:  # TRL's per-micro-batch term, weighted by zero: see below
            self.router_aux_loss_coef = 0.0
        try:
            with self._router_logits(model, routing) as seen:
                loss = DPOTrainer._compute_loss(self, model, inputs, False)
        finally:
            self.loss_weights, self.router_aux_loss_coef = weights, coef
        loss_sum = loss * totals[_PAIRS].item()
        if routing is not None:
            if len(metrics.get("aux_loss", ())) > before.get("aux_loss", 0):
                metrics["aux_loss"].pop()  # the micro-batch's; the window's is logged at its end
            aux = routing.term_of(self._policy_logits(seen), inputs["attention_mask"])
            loss_sum = loss_sum + aux.to(loss_sum.dtype)
            scale = routing.items * routing.aux.coef
            self._fb_aux = [aux.detach() / scale if scale else aux.detach()]
        self._window_metrics(k, metrics, before)
        return loss_sum, torch.tensor(pairs, device=loss.device)

    def _router_logits(
        self, model: torch.nn.Module, routing: WindowRouting | None
    ) -> AbstractContextManager[list[Any]]:
        if routing is None:
            return nullcontext([])
        return router_logits_of(self.accelerator.unwrap_model(model))

    _policy_logits = staticmethod(policy_router_logits)

    def exact_micro_stats(self) -> list[torch.Tensor]:
        stats, self._fb_aux = self._fb_aux, []
        return [s.double().reshape(1).to(self.args.device) for s in stats]

    def _window_metrics(self, k: int, metrics: dict[str, list[float]], before: dict) -> None:
        """Move the metrics TRL appended for micro-batch ``k`` into window sums, weighted by
        that micro-batch's count (all ranks) of what TRL averaged them over."""
        for key in list(metrics):
            if key == "num_tokens" or len(metrics[key]) <= before.get(key, 0):
                continue
            value = metrics[key].pop()
            weight = float(self._fb_counts[k, list(_METRIC_WEIGHT.get(key, (_PAIRS,)))].sum())
            total = self._fb_sums.setdefault(key, [0.0, 0.0])
            total[0] += value * weight
            total[1] += weight

    def exact_window_end(self, totals: list[float]) -> None:
        for key, (weighted, weight) in self._fb_sums.items():
            self._metrics["train"][key].append(weighted / weight if weight > 0 else 0.0)
        self._fb_sums = {}
        if len(totals) > 2:  # the window's load-balancing loss (TRL logs each micro-batch's)
            self._metrics["train"]["aux_loss"].append(totals[2])


ExactDPOTrainer.__init__.__signature__ = inspect.signature(DPOTrainer.__init__)  # type: ignore[attr-defined]

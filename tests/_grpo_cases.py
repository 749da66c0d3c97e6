"""GRPO runs on CPU for tests and the benchmark: a tokenizer built in code, a tiny random
Qwen2 policy in float64, short completions sampled on CPU, a reward function, and the plain
reference: the objective of each loss type over exactly one optimizer step's sequences.

``run(trainer_cls, **config)`` trains a few steps and records, for every optimizer step, the
parameters before its first backward, every micro-batch TRL trained on (prepared inputs) and
the gradient the optimizer received. ``reference_grads`` recomputes each step's gradient from
those recorded sequences alone: per-token log-probabilities and entropies from the model's
logits (per micro-batch forward, in TRL's padding layout), then the window's objective in one
expression over all of the step's tokens. It never calls fullbatch or TRL's loss code.
"""

from __future__ import annotations

import tempfile
import warnings
from types import SimpleNamespace
from typing import Any

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    TrainerCallback,
)

VOCAB = ["<pad>", "<eos>", *"abcdefghij"]
PROMPTS = ["ab", "cde", "f", "ghij", "aa", "bcb", "jj", "ie", "dd", "hgf", "c", "ejb"]


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate(VOCAB)}
    inner = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    inner.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=inner, pad_token="<pad>", eos_token="<eos>")


def policy(seed: int = 0, moe: bool | str = False, dtype: torch.dtype = torch.float64) -> Any:
    """A tiny Qwen2 in ``dtype``; with ``moe``, a Qwen2-MoE (``True`` or ``"qwen2_moe"``: 1
    layer, 4 experts, 2 per token, a shared expert), or a Mixtral, Qwen3-MoE or OLMoE
    (``"mixtral"``, ``"qwen3_moe"``, ``"olmoe"``: 2 layers, 4 experts, 2 per token)."""
    common: dict[str, Any] = dict(
        vocab_size=len(VOCAB),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    routed = {"num_experts_per_tok": 2, "output_router_logits": False}
    routed.update(experts_implementation="eager")  # grouped_mm has no float64
    kind: Any
    if moe == "mixtral":
        common.update(routed, num_local_experts=4, num_hidden_layers=2)
        kind, model_cls = MixtralConfig, MixtralForCausalLM
    elif moe == "qwen3_moe":
        common.update(routed, num_experts=4, moe_intermediate_size=16, num_hidden_layers=2)
        kind, model_cls = Qwen3MoeConfig, Qwen3MoeForCausalLM
    elif moe == "olmoe":
        common.update(routed, num_experts=4, num_hidden_layers=2)
        kind, model_cls = OlmoeConfig, OlmoeForCausalLM
    elif moe:
        common.update(routed, num_experts=4, moe_intermediate_size=16)
        common.update(shared_expert_intermediate_size=16)
        kind, model_cls = Qwen2MoeConfig, Qwen2MoeForCausalLM
    else:
        kind, model_cls = Qwen2Config, Qwen2ForCausalLM
    config = kind(**common)
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype)
    with torch.no_grad():  # end completions sooner, so that their lengths differ
        model.lm_head.weight[1] += 0.3 * model.lm_head.weight.abs().mean()
    return model


def moe_kind(model_or_params: Any) -> bool | str:
    """What :func:`policy` takes to rebuild this model (or these named parameters)."""
    names = (
        model_or_params
        if isinstance(model_or_params, dict)
        else dict(model_or_params.named_parameters())
    )
    if "model.layers.0.mlp.gate.weight" not in names:
        return False
    if any("shared_expert" in n for n in names):
        return "qwen2_moe"
    q_norm = names.get("model.layers.0.self_attn.q_norm.weight")
    if q_norm is None:
        return "mixtral"
    # OLMoE normalizes the whole query (hidden size), Qwen3-MoE each head (head_dim)
    return (
        "olmoe" if q_norm.shape[0] == names["model.embed_tokens.weight"].shape[1] else "qwen3_moe"
    )


def reward(completions: list[str], **kwargs: Any) -> list[float]:
    return [float(c.count("a") + c.count("b")) - 0.2 * len(c) for c in completions]


def dataset() -> Any:
    from datasets import Dataset

    return Dataset.from_dict({"prompt": PROMPTS * 4})


class _Recorder(TrainerCallback):
    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.steps: list[dict[str, Any]] = []

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        params = {k: v.detach().clone() for k, v in self.trainer.model.named_parameters()}
        self.steps.append({"params": params, "micro": []})

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.steps[-1]["grads"] = {
            k: v.grad.detach().clone() for k, v in self.trainer.model.named_parameters()
        }


def recording(trainer_cls: type) -> type:
    """A subclass of ``trainer_cls`` that records the prepared inputs of every micro-batch."""

    class Recording(trainer_cls):  # type: ignore[misc, valid-type]
        def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
            if self.model.training:
                kept = {k: v.detach().clone() for k, v in inputs.items() if torch.is_tensor(v)}
                self._recorder.steps[-1]["micro"].append(kept)
            return super()._compute_loss(model, inputs)

    return Recording


def run(
    trainer_cls: type,
    *,
    max_steps: int = 4,
    seed: int = 0,
    moe: bool | str = False,
    dtype: torch.dtype = torch.float64,
    recorder: type = _Recorder,
    rewards: Any = reward,
    **config: Any,
) -> Any:
    from trl import GRPOConfig

    options: dict[str, Any] = {
        "per_device_train_batch_size": 4,
        "num_generations": 4,
        "max_completion_length": 6,
        "learning_rate": 0.05,
        "max_grad_norm": 0.0,
        "lr_scheduler_type": "constant",
        "optim": "sgd",
        "use_cpu": True,
        "bf16": False,  # GRPOConfig defaults to bf16 autocast, also on CPU
        "report_to": [],
        "save_strategy": "no",
        "logging_steps": 1,
        "disable_tqdm": True,
        "seed": seed,
        "max_steps": max_steps,
    }
    options.update(config)
    model: Any = policy(seed, moe, dtype)
    if options.get("beta"):
        # TRL builds the KL reference model from the policy's path: save the policy there
        model.save_pretrained(path := tempfile.mkdtemp())
        model, options["model_init_kwargs"] = path, {"dtype": torch.float64}
    args = GRPOConfig(output_dir=tempfile.mkdtemp(), **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = recording(trainer_cls)(
            model=model,
            reward_funcs=rewards,
            args=args,
            train_dataset=dataset(),
            processing_class=tokenizer(),
        )
        trainer._recorder = recorder(trainer)
        trainer.add_callback(trainer._recorder)
        trainer.train()
    return trainer


def _token_terms(model: Any, micro: dict[str, torch.Tensor]) -> tuple[Any, ...]:
    """Per-token log-probabilities and entropies of one micro-batch's forward (TRL's padding
    layout), with, on an MoE model, its aux loss, router logits and attention mask."""
    ids = torch.cat([micro["prompt_ids"], micro["completion_ids"]], dim=1)
    mask = torch.cat([micro["prompt_mask"], micro["completion_mask"]], dim=1)
    width = micro["completion_ids"].shape[1]
    moe = {"output_router_logits": True} if moe_kind(model) else {}
    outputs = model(input_ids=ids, attention_mask=mask, **moe)
    logp = outputs.logits[:, -width - 1 : -1].double().log_softmax(-1)
    token_logp = logp.gather(-1, micro["completion_ids"][..., None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    routed = (getattr(outputs, "aux_loss", None), getattr(outputs, "router_logits", None), mask)
    return token_logp, entropy, routed


def window_aux(model: Any, routed: list[tuple[Any, ...]]) -> torch.Tensor:
    """The load-balancing loss of one full batch made of all the micro-batches' forwards:
    every forward's router logits pooled per layer and their attention masks concatenated,
    written out in float64 (``_moe_cases.aux64``); transformers' own
    ``load_balancing_loss_func`` (which sums in float32) agrees to that precision."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from _moe_cases import EXPERTS, TOP_K, aux64

    text = model.config
    assert (text.num_experts, text.num_experts_per_tok) == (EXPERTS, TOP_K)
    layers = tuple(torch.cat(layer) for layer in zip(*(r[1] for r in routed), strict=True))
    mask = torch.cat([r[2].reshape(-1) for r in routed])[None]
    value = aux64(layers, mask)
    stock = load_balancing_loss_func(layers, EXPERTS, TOP_K, mask).detach()
    assert abs(float(stock) - value.item()) < 1e-6 * abs(value.item()), (stock, value)
    return value


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, width - x.shape[1]))


def settings(trainer: Any) -> dict[str, Any]:
    """What the objective needs from a trainer's configuration (picklable)."""
    args = trainer.args
    keys = ("loss_type", "beta", "use_bias_correction_kl", "epsilon_high", "entropy_coef")
    keys += ("sapo_temperature_pos", "sapo_temperature_neg", "max_completion_length")
    out = {key: getattr(args, key) for key in keys}
    out["epsilon_low"] = args.epsilon
    out["epsilon_high"] = args.epsilon if args.epsilon_high is None else args.epsilon_high
    out["router"] = trainer.router_aux_loss_coef if trainer.aux_loss_enabled else 0.0
    out["moe"] = moe_kind(trainer.model)
    # the router loss fullbatch's trainer takes over the window; TRL's, per micro-batch
    out["router_window"] = hasattr(trainer, "fullbatch_route")
    return out


def objective(config: dict[str, Any], model: Any, micros: list[dict[str, Any]]) -> torch.Tensor:
    """The loss type's objective over all the sequences of ``micros`` (one optimizer step)."""
    args = SimpleNamespace(**config)
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("lp", "ent", "old", "ref", "m")}
    advantages, routers = [], []
    for micro in micros:
        lp, ent, router = _token_terms(model, micro)
        routers.append(router)
        parts["lp"].append(lp)
        parts["ent"].append(ent)
        parts["old"].append(micro.get("old_per_token_logps", lp.detach()))
        parts["ref"].append(micro.get("ref_per_token_logps", lp.detach()))
        parts["m"].append(micro["completion_mask"].double())
        advantages.append(micro["advantages"])
    width = max(x.shape[1] for x in parts["lp"])
    lp, ent, old, ref, m = (torch.cat([_pad(x, width) for x in parts[k]]) for k in parts)
    adv = torch.cat(advantages)[:, None]
    ratio = torch.exp(lp - old)
    kind = args.loss_type
    if kind == "cispo":
        loss = -torch.clamp(ratio, max=args.epsilon_high).detach() * adv * lp
    elif kind == "sapo":
        tau = torch.where(adv > 0, args.sapo_temperature_pos, args.sapo_temperature_neg)
        loss = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv
    else:
        low, high = args.epsilon_low, args.epsilon_high
        loss = -torch.min(ratio * adv, torch.clamp(ratio, 1 - low, 1 + high) * adv)
    if args.beta:
        kl = torch.exp(ref - lp) - (ref - lp) - 1
        kl = kl * ratio if args.use_bias_correction_kl else kl
        loss = loss + args.beta * kl
    sequences, tokens = m.shape[0], m.sum().clamp(min=1)
    if kind in ("grpo", "sapo"):
        total = ((loss * m).sum(1) / m.sum(1).clamp(min=1)).sum() / sequences
    elif kind == "dr_grpo":
        total = (loss * m).sum() / (sequences * args.max_completion_length)
    else:
        total = (loss * m).sum() / tokens
    total = total - args.entropy_coef * (ent * m).sum() / tokens
    if args.router and args.router_window:  # the load-balancing loss of the whole window
        total = total + args.router * window_aux(model, routers)
    elif args.router:  # TRL's: each micro-batch's own, the micro-batches' mean
        total = total + args.router * torch.stack([r[0] for r in routers]).mean()
    return total


def reference(config: dict[str, Any], step: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """The window objective's gradient and value at the step's parameters."""
    # a fresh model: a deepcopy of the trained one would keep forward methods bound to it
    model = policy(moe=config["moe"])
    model.load_state_dict(step["params"])
    value = objective(config, model, step["micro"])
    value.backward()
    return {k: v.grad for k, v in model.named_parameters()}, float(value.detach())


def window_entropy(step: dict[str, Any]) -> float:
    """The token mean of the entropy over the step's sequences, at its parameters."""
    model = policy(moe=moe_kind(step["params"]))
    model.load_state_dict(step["params"])
    with torch.no_grad():
        total = count = 0.0
        for micro in step["micro"]:
            ent = _token_terms(model, micro)[1]
            total += float((ent * micro["completion_mask"]).sum())
            count += float(micro["completion_mask"].sum())
    return total / max(count, 1.0)


def window_aux_value(step: dict[str, Any]) -> float:
    """The load-balancing loss of the step's sequences (all micro-batches), at its parameters."""
    model = policy(moe=moe_kind(step["params"]))
    model.load_state_dict(step["params"])
    with torch.no_grad():
        return float(window_aux(model, [_token_terms(model, m)[2] for m in step["micro"]]))


def window_kl(config: dict[str, Any], step: dict[str, Any]) -> float:
    """The token mean of TRL's per-token KL estimate over the step's sequences."""
    model = policy(moe=config["moe"])
    model.load_state_dict(step["params"])
    total = count = 0.0
    with torch.no_grad():
        for micro in step["micro"]:
            lp = _token_terms(model, micro)[0]
            ref, old = micro["ref_per_token_logps"], micro.get("old_per_token_logps", lp)
            kl = torch.exp(ref - lp) - (ref - lp) - 1
            kl = kl * torch.exp(lp - old) if config["use_bias_correction_kl"] else kl
            total += float((kl * micro["completion_mask"]).sum())
            count += float(micro["completion_mask"].sum())
    return total / max(count, 1.0)


def step_errors(config: dict[str, Any], steps: list[dict[str, Any]]) -> list[float]:
    """Relative L2 error of each optimizer step's gradient against the window's objective."""
    errors = []
    for step in steps:
        ref = reference(config, step)[0]
        num = sum(((step["grads"][k] - ref[k]) ** 2).sum() for k in ref)
        den = sum((ref[k] ** 2).sum() for k in ref)
        errors.append(float((num / den).sqrt()))
    return errors


def ddp_rank(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One gloo rank (the group is initialized already, tests/_dist.py): each case trained
    with ExactGRPOTrainer and (unless ``stock=False``) stock GRPOTrainer; the recorded steps
    come back."""
    import os

    from trl import GRPOTrainer

    from fullbatch.trl import ExactGRPOTrainer

    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="1",  # never used: accelerate finds the process group initialized
        OMP_NUM_THREADS="1",
    )
    out = []
    for case in cases:
        result = {}
        stock = case.pop("stock", True)
        for cls in (ExactGRPOTrainer, GRPOTrainer) if stock else (ExactGRPOTrainer,):
            trainer = run(cls, **case)
            assert trainer.accelerator.num_processes == world
            assert isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel)
            result[cls.__name__] = {"steps": trainer._recorder.steps, "config": settings(trainer)}
        out.append(result)
    return out

"""ExactDPOTrainer on a tiny transformers MoE model: runs, and the plain full-batch reference.

The reference never calls fullbatch or TRL: one forward of the window's ``2P`` sequences
(every pair's prompt + chosen, then prompt + rejected, right-padded) with the router logits,
``w · mean_pairs(-log σ(β Δ))`` plus ``coef`` times the pooled load-balancing loss of that one
forward (:func:`_moe_cases.aux64`, float64; it agrees with transformers'
``load_balancing_loss_func``, which sums in float32, to that precision), one backward, one SGD
step. Module-level functions: importable by the forkserver ranks of the DDP test.
"""

from __future__ import annotations

import os
import tempfile
import time
import warnings
from typing import Any

import torch
import torch.nn.functional as F

from _moe_cases import COEF, EXPERTS, TOP_K, aux64
from _trl_cases import LR, Recording
from _trl_dpo_cases import BETA, dpo_config, pairs

VOCAB = 100  # the character tokenizer's ids
FAMILIES = ("mixtral", "olmoe")
LAYERS = 2


def moe_lm(family: str, seed: int = 0, *, router_logits: bool = False) -> Any:
    """A tiny float64 MoE causal LM (4 experts, top 2, ``router_aux_loss_coef`` 0.25, 2 layers)
    over the character tokenizer's vocabulary; ``output_router_logits`` off unless
    ``router_logits`` (TRL turns the router logits on for its coefficient either way)."""
    import transformers

    torch.manual_seed(seed)
    common: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=LAYERS,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        num_experts_per_tok=TOP_K, router_aux_loss_coef=COEF, experts_implementation="eager",
        attn_implementation="eager", pad_token_id=0, eos_token_id=1, bos_token_id=2,
        output_router_logits=router_logits,
    )  # fmt: skip
    if family == "mixtral":
        config = transformers.MixtralConfig(num_local_experts=EXPERTS, **common)
        cls: Any = transformers.MixtralForCausalLM
    elif family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            num_experts=EXPERTS, moe_intermediate_size=12, norm_topk_prob=True, **common
        )
        cls = transformers.Qwen3MoeForCausalLM
    else:
        config = transformers.OlmoeConfig(num_experts=EXPERTS, **common)
        cls = transformers.OlmoeForCausalLM
    return cls(config).double()


def params(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def run(
    family: str,
    n: int,
    *,
    k: int,
    batch: int,
    exact: bool = True,
    router_logits: bool = False,
    **overrides: Any,
) -> dict[str, Any]:
    """Train ``ExactDPOTrainer`` (or the stock ``DPOTrainer``: ``exact=False``) with SGD
    (``LR``) on ``pairs(n)`` (this rank's share under DDP), ``batch`` pairs per micro-batch,
    ``k`` per window, one step unless ``max_steps=`` says otherwise: the parameters before and
    after each step, the rows of each micro-batch, the logs, and the routing pre-passes that
    ran (``window_routing`` calls: the window's routed rows and pairs, and their seconds), and
    the Trainer's ``train_runtime``."""
    from transformers import TrainerCallback
    from trl import DPOTrainer

    import fullbatch.trl._dpo as dpo_module
    from fullbatch._demo._trl_tiny import char_tokenizer

    model = moe_lm(family, router_logits=router_logits)
    steps = [params(model)]
    prepasses = []
    original = dpo_module.window_routing

    def counting(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        routing = original(*args, **kwargs)
        seconds = time.perf_counter() - start
        prepasses.append(
            {"rows": float(routing.counts["rows"]), "items": routing.items, "seconds": seconds}
        )
        return routing

    class Record(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            steps.append(params(kw["model"]))

    cls = dpo_module.ExactDPOTrainer if exact else DPOTrainer
    dpo_module.window_routing = counting  # type: ignore[assignment]
    try:
        with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer: Any = cls(
                model=model,
                ref_model=moe_lm(family, router_logits=router_logits),
                args=dpo_config(tmp, k=k, batch=batch, **{"max_steps": 1, **overrides}),
                train_dataset=pairs(n),
                processing_class=char_tokenizer(),
                callbacks=[Record()],
            )
            recording = Recording(trainer.data_collator)
            trainer.data_collator = recording
            trainer.train()
    finally:
        dpo_module.window_routing = original  # type: ignore[assignment]
    return {
        "steps": steps,
        "seen": recording.seen,
        "logs": [h for h in trainer.state.log_history if "loss" in h],
        "prepasses": prepasses,
        "world": trainer.accelerator.num_processes,
        "seconds": trainer.state.log_history[-1]["train_runtime"],
    }


def tokens(rows: list[dict]) -> int:
    """The real tokens of the window's ``[chosen; rejected]`` sequences."""
    return sum(2 * len(r["prompt_ids"]) + len(r["chosen_ids"] + r["rejected_ids"]) for r in rows)


def _batch(rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The window's ``[prompt + chosen; prompt + rejected]`` rows, right-padded: input ids,
    attention mask, completion mask."""
    seqs, comp = [], []
    for key in ("chosen_ids", "rejected_ids"):
        for r in rows:
            seqs.append(r["prompt_ids"] + r[key])
            comp.append([0] * len(r["prompt_ids"]) + [1] * len(r[key]))
    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    mask = torch.tensor([c + [0] * (width - len(c)) for c in comp])
    return ids, attn, mask


def _logps(model: Any, ids: torch.Tensor, attn: torch.Tensor, mask: torch.Tensor) -> tuple:
    """Each sequence's completion log-probability, and the forward's router logits."""
    out = model(input_ids=ids, attention_mask=attn, output_router_logits=True)
    token = F.log_softmax(out.logits[:, :-1].double(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    return (token * mask[:, 1:]).sum(1), out.router_logits


def reference(
    family: str,
    rows: list[dict],
    start: dict[str, torch.Tensor],
    *,
    weight: float = 1.0,
    coef: float = COEF,
) -> dict[str, Any]:
    """The full-batch step on the window ``rows`` from parameters ``start``: the parameters
    after one SGD step on ``weight · sigmoid DPO + coef · aux``, and the window's aux value."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    model, ref_model = moe_lm(family), moe_lm(family)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(start[n])
    ids, attn, mask = _batch(rows)
    logps, router = _logps(model, ids, attn, mask)
    with torch.no_grad():
        ref_logps, _ = _logps(ref_model, ids, attn, mask)
    chosen, rejected = (logps - ref_logps).chunk(2)
    dpo = -F.logsigmoid(BETA * (chosen - rejected)).mean()
    aux = aux64(router, attn)
    stock = load_balancing_loss_func(tuple(router), EXPERTS, TOP_K, attn)
    assert abs(float(stock) - float(aux)) < 1e-6 * float(aux), (float(stock), float(aux))
    # The loss summed over the P pairs, its gradient divided by P: ExactDPOTrainer's rounding
    # (the model's float32 casts, in its norms, attention and router softmax, round the
    # backward relative to the scale it is given; float64 alone would not need this).
    n = len(rows)
    (n * (weight * dpo + coef * aux)).backward()
    after = {n_: (p - LR * _grad(p) / n).detach() for n_, p in model.named_parameters()}
    return {"after": after, "aux": float(aux), "dpo": float(dpo)}


def _grad(p: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(p) if p.grad is None else p.grad


def per_micro_step(
    family: str,
    micro: list[list[dict]],
    start: dict[str, torch.Tensor],
    *,
    weight: float = 1.0,
    coef: float = COEF,
) -> dict[str, torch.Tensor]:
    """What a per-micro-batch aux term gives, the pairs otherwise exact: ``weight`` times the
    window's sigmoid DPO plus ``coef · Σ_m (P_m / P) · aux_m``, each micro-batch's own
    load-balancing loss weighted by its share of the pairs."""
    model, ref_model = moe_lm(family), moe_lm(family)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(start[n])
    total = sum(len(rows) for rows in micro)
    for rows in micro:
        ids, attn, mask = _batch(rows)
        logps, router = _logps(model, ids, attn, mask)
        with torch.no_grad():
            ref_logps, _ = _logps(ref_model, ids, attn, mask)
        chosen, rejected = (logps - ref_logps).chunk(2)
        dpo = -F.logsigmoid(BETA * (chosen - rejected)).sum() / total
        (weight * dpo + coef * len(rows) / total * aux64(router, attn)).backward()
    return {n: (p - LR * _grad(p)).detach() for n, p in model.named_parameters()}


def step_error(got: dict, want: dict, before: dict) -> float:
    """``‖got - want‖ / ‖want - before‖`` over all parameters."""
    diff = sum(float((got[n] - want[n]).pow(2).sum()) for n in want)
    moved = sum(float((want[n] - before[n]).pow(2).sum()) for n in want)
    return (diff / moved) ** 0.5


def ddp_rank(rank: int, world: int, family: str, n: int, k: int, batch: int) -> dict[str, Any]:
    """One rank of the ExactDPOTrainer MoE DDP test (the gloo group is up: tests/_dist.py)."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT="1", OMP_NUM_THREADS="1",
    )  # fmt: skip
    return run(family, n, k=k, batch=batch)


def probed_ddp_rank(rank: int, world: int, n: int, k: int, batch: int) -> dict[str, Any]:
    """One rank of the probe's DPO MoE DDP test: ``ExactDPOTrainer`` then the stock trainer,
    one probed window each; what each trained (as :func:`run`) and its window's verdict."""
    import fullbatch as fb

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT="1", OMP_NUM_THREADS="1",
    )  # fmt: skip
    out = {}
    for name, exact in (("exact", True), ("stock", False)):
        with fb.probe(windows=1) as probe:
            got = run("mixtral", n, k=k, batch=batch, exact=exact)
        (w,) = probe.report.windows
        out[name] = {
            **got, "ok": probe.report.ok, "patterns": w.patterns, "objective": w.objective,
            "share": w.statistic_share, "error": w.error, "tolerance": w.tolerance,
        }  # fmt: skip
    return out

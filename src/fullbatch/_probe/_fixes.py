"""What to change: the fix for each pattern, on the engine that stepped the optimizer."""

from __future__ import annotations

from fullbatch._probe._engines import Engine
from fullbatch._probe._window_stat import NAMED

__all__ = ["fix"]

_ACCUMULATOR = (
    "accumulate with fb.Accumulator(model, optimizer, micro_batches=K) and "
    "window.backward(loss_sum, count): it divides by the window's item count over every "
    "micro-batch and rank"
)


def _moe_route(engine: Engine) -> str:
    """Where the MoE load-balancing loss is exact over a window (docs/moe.md)."""
    prepass = "a pre-pass gives every micro-batch the window's counts; docs/moe.md"
    if engine.package == "transformers" and not engine.fullbatch:
        return (
            "use fullbatch.hf.ExactTrainer(..., loss='causal_lm') in place of the Trainer "
            f"({prepass})"
        )
    for name in ("SFTTrainer", "DPOTrainer"):
        if engine.package == "trl" and name in (engine.trainer or ""):
            return f"use fullbatch.trl.Exact{name} in place of trl.{name} ({prepass})"
    if engine.package == "deepspeed":  # a raw engine: ExactEngine's windows take statistics
        return (
            "drive the engine with fullbatch.deepspeed.ExactEngine: counts = window.stats(fn) "
            "with fn returning fb.moe.router_counts(out.router_logits, top_k=k, "
            "attention_mask=...), and coef * fb.moe.load_balancing(out.router_logits, counts, "
            "attention_mask=...) added to each micro-batch's loss; with the Hugging Face "
            f"Trainer, fullbatch.hf.ExactTrainer(..., loss='causal_lm') ({prepass})"
        )
    return (
        "counts = window.stats(fn) with fn returning fb.moe.router_counts(out.router_logits, "
        "top_k=k, attention_mask=...), and coef * fb.moe.load_balancing(out.router_logits, "
        "counts, attention_mask=...) added to each micro-batch's loss in fb.Accumulator "
        "(docs/moe.md)"
    )


def _route(engine: Engine) -> str:
    """The fullbatch route that makes this engine's accumulation exact."""
    if engine.fullbatch:
        return (
            f"{engine.name} is fullbatch's own route, so its loss is not the declared objective: "
            "make loss= (or exact_loss / the returned count) and the probe's objective= the "
            "same loss"
        )
    package, trainer = engine.package, engine.trainer or ""
    if package == "trl":
        for name in ("SFTTrainer", "DPOTrainer", "GRPOTrainer"):
            if name in trainer:
                return f"use fullbatch.trl.Exact{name} in place of trl.{name} (same arguments)"
        return "subclass class Exact(fullbatch.hf.ExactTrainer, YourTrainer) with exact_loss"
    if package == "transformers":
        return "use fullbatch.hf.ExactTrainer(..., loss=...) in place of the Trainer"
    if package == "lightning":
        return (
            "add fullbatch.lightning.ExactAccumulation() to the Trainer's callbacks and return "
            "{'loss': loss_sum, 'count': n} from training_step"
        )
    if package == "deepspeed":  # a raw engine, or Accelerate's DeepSpeed plugin
        return (
            "drive the engine with exact = fullbatch.deepspeed.ExactEngine(engine, count=fn): "
            "for window in exact.windows(loader), window.backward(loss_sum, count) for each "
            "micro-batch, then window.step()"
        )
    if package == "accelerate":
        return f"{_ACCUMULATOR} (on the prepared model and optimizer, instead of accumulate())"
    if package == "composer":
        return (
            "count and average the same tokens with counts = fullbatch.composer.TokenCounts(): "
            "DataSpec(loader, get_num_tokens_in_batch=counts), the model's loss returns "
            "counts.loss(logits, batch), and Trainer(accumulate_train_batch_on_tokens=True)"
        )
    if package == "colossalai":
        return (
            f"{_ACCUMULATOR} (on the boosted model and optimizer; ddp_sync='step' when a "
            "micro-batch takes several backward passes)"
        )
    if package == "super_gradients":
        return (
            "use fullbatch.super_gradients.ExactTrainer in place of Trainer (same arguments) "
            "with training_params['loss'] = SummedLoss(fn), fn(outputs, targets) -> "
            "(loss_sum, count)"
        )
    return _ACCUMULATOR


def fix(pattern: str, engine: Engine, refused: str | None = None) -> str:
    """One sentence: what to change for ``pattern`` on ``engine``; ``refused``: why fullbatch's
    own routes refuse this engine's configuration (then the fix names what they accept,
    never a route that would refuse it).

    >>> fix("leftover gradient", Engine("a hand-written loop"))
    'Fix: call optimizer.zero_grad(set_to_none=True) after every step and once before the loop.'
    """
    if refused is not None and pattern not in ("leftover gradient", "scaled clip", "clip differs"):
        return (
            f"Fix: {refused}; fullbatch's routes refuse this configuration for that reason "
            "(in a configuration they accept, they make the step exact)."
        )
    if pattern == "leftover gradient":
        return (
            "Fix: call optimizer.zero_grad(set_to_none=True) after every step and once before "
            "the loop."
        )
    if pattern == "ranks differ":
        return (
            "Fix: let the wrapper reduce gradients on each rank's last micro-batch of the window "
            "(DDP: no_sync() on the others only, and one backward per micro-batch: DDP reduces "
            "the first) so every replica applies the same gradient, or "
            f"{_ACCUMULATOR}."
        )
    if pattern == "scaled clip":
        return (
            "Fix: unscale before clipping: scaler.scale(loss).backward(), then "
            "scaler.unscale_(optimizer), then clip_grad_norm_(...), then "
            "scaler.step(optimizer) and scaler.update()."
        )
    if pattern == "clip differs":
        return (
            "Fix: make the two one: with the Hugging Face Trainer and DeepSpeed, set "
            '"gradient_clipping": "auto" in the DeepSpeed config (it then follows '
            "max_grad_norm), or the same value in both places."
        )
    if pattern == "counted twice":
        return f"Fix: one backward per micro-batch (sum its loss terms first), or {_route(engine)}."
    if pattern == NAMED:
        return f"Fix: take the routing counts over the whole window: {_moe_route(engine)}."
    if pattern == "loss differs":
        return (
            "Fix: declare the loss you train, objective=fn(model, micro) -> (loss_sum, count) "
            "summed over the micro-batch's items (--objective FILE.py:FN), and probe again; "
            "what remains is then the accumulation's."
        )
    if pattern == "per-rank count":
        return (
            "Fix: divide every rank's loss sum by the window's item count over all ranks (one "
            "all-reduce of the count before backward, then multiply by the world size that DDP "
            f"averages over), or {_ACCUMULATOR}."
        )
    if pattern == "partial window":
        return (
            "Fix: normalize a short window by its own item count, and step after micro-batches "
            "K, 2K, ... ((batch_idx + 1) % K == 0), or "
            f"{_route(engine)} (partial_window='step' or 'drop')."
        )
    return f"Fix: {_route(engine)}."

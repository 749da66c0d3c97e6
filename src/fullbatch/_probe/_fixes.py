"""What to change: the fix for each pattern, on the engine that stepped the optimizer."""

from __future__ import annotations

from fullbatch._probe._where import Engine

__all__ = ["fix"]

_ACCUMULATOR = (
    "accumulate with fb.Accumulator(model, optimizer, micro_batches=K) and "
    "window.backward(loss_sum, count): it divides by the window's item count over every "
    "micro-batch and rank"
)


def _route(engine: Engine) -> str:
    """The fullbatch route that makes this engine's accumulation exact."""
    name = engine.name
    if engine.fullbatch:
        return (
            f"{name} is fullbatch's own route, so its loss is not the declared objective: make "
            "loss= (or exact_loss / the returned count) and the probe's objective= the same loss"
        )
    for trainer in ("SFTTrainer", "DPOTrainer", "GRPOTrainer"):
        if name.startswith("trl.") and trainer in name:
            return f"use fullbatch.trl.Exact{trainer} in place of trl.{trainer} (same arguments)"
    if name.startswith("trl."):
        return "subclass class Exact(fullbatch.hf.ExactTrainer, YourTrainer) with exact_loss"
    if "transformers" in name:
        return "use fullbatch.hf.ExactTrainer(..., loss=...) in place of the Trainer"
    if name == "Lightning":
        return (
            "add fullbatch.lightning.ExactAccumulation() to the Trainer's callbacks and return "
            "{'loss': loss_sum, 'count': n} from training_step"
        )
    if name == "Accelerate":
        return f"{_ACCUMULATOR} (on the prepared model and optimizer, instead of accumulate())"
    if name == "Composer":
        return (
            "count and average the same tokens with counts = fullbatch.composer.TokenCounts(): "
            "DataSpec(loader, get_num_tokens_in_batch=counts), the model's loss returns "
            "counts.loss(logits, batch), and Trainer(accumulate_train_batch_on_tokens=True)"
        )
    if name == "ColossalAI":
        return (
            f"{_ACCUMULATOR} (on the boosted model and optimizer; ddp_sync='step' when a "
            "micro-batch takes several backward passes)"
        )
    if name == "Super-Gradients":
        return f"{_ACCUMULATOR} (a loop around the model and its loss, not batch_accumulate)"
    return _ACCUMULATOR


def fix(pattern: str, engine: Engine) -> str:
    """One sentence: what to change for ``pattern`` on ``engine``.

    >>> fix("leftover gradient", Engine("a hand-written loop"))
    'Fix: call optimizer.zero_grad(set_to_none=True) after every step and once before the loop.'
    """
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
    if pattern == "counted twice":
        return f"Fix: one backward per micro-batch (sum its loss terms first), or {_route(engine)}."
    if pattern == "partial window":
        return (
            "Fix: normalize a short window by its own item count, and step after micro-batches "
            "K, 2K, ... ((batch_idx + 1) % K == 0), or "
            f"{_route(engine)} (partial_window='step' or 'drop')."
        )
    return f"Fix: {_route(engine)}."

"""The objective a trainer trains, where it is known; otherwise a refusal, never a guess.

With ``objective=None`` the probe used to infer the objective from the model's head alone, so
a trainer whose loss is not the head's (TRL's ``DPOTrainer`` on a causal LM: a loss per
preference pair) was judged under ``causal_lm`` and called wrong. At the first forward of the
run (before any backward: nothing has moved yet), the engine found above it
(:mod:`fullbatch._probe._engines`) answers:

- ``fullbatch.hf.ExactTrainer(loss="token")`` and its subclasses: the ``loss=`` it declared
  (``"seq2seq"`` is ``"token"`` on the decoder's targets);
- TRL's ``SFTTrainer`` (and ``fullbatch.trl.ExactSFTTrainer``) with ``loss_type="nll"``:
  ``"causal_lm"``, the next-token mean over the labels its collator builds;
- TRL's other trainers (DPO, KTO, ORPO, GRPO, RLOO, reward, ...), SFT's ``dft``, a
  ``ExactTrainer`` whose loss is a function, a Hugging Face ``Trainer`` with
  ``compute_loss_func``, ``label_smoothing_factor`` or an overridden ``compute_loss``: the
  objective is not the head's and cannot be written as a built-in one: :class:`Unknown`
  (``fullbatch probe`` exits 2 naming the trainer and how to declare it);
- anything else (a loop, a plain ``Trainer``, Lightning): None: the head decides, as before.

On a transformers MoE model whose forward adds its router aux loss, a trainer's
``"causal_lm"`` is ``"causal_lm+moe"`` (:mod:`fullbatch._probe._moe_objective`): the trainer
trains the load balancing too.
"""

from __future__ import annotations

from typing import Any

from fullbatch._probe._engines import Engine

__all__ = ["ObjectiveUnknown", "Unknown", "trainer_objective"]

#: TRL trainers whose objective is no built-in one, by class name.
_TRL_OTHERS = (
    "DPOTrainer", "KTOTrainer", "ORPOTrainer", "CPOTrainer", "GRPOTrainer", "RLOOTrainer",
    "PPOTrainer", "RewardTrainer", "OnlineDPOTrainer", "NashMDTrainer", "XPOTrainer",
    "GKDTrainer", "BCOTrainer", "PRMTrainer",
)  # fmt: skip


class Unknown(ValueError):
    """The objective of the trainer that runs cannot be inferred: the probe will not guess."""


class ObjectiveUnknown(ValueError):
    """``objective=None`` on a model whose objective cannot be inferred: raised at its first
    forward, before any backward or step (``module``: its class name)."""

    def __init__(self, message: str, module: str) -> None:
        super().__init__(message)
        self.module = module


def _declare(trainer: str, why: str) -> Unknown:
    return Unknown(
        f"objective=None: cannot infer the objective for {trainer}: {why}; declare it: "
        "objective=fn(model, micro) -> (loss_sum, count), the loss summed over the "
        "micro-batch's items (fullbatch probe --objective FILE.py:FN), or a built-in name where "
        "one fits (causal_lm, token, sample). Nothing was trained."
    )


def _trl(cls: type, trainer: Any) -> tuple[str, str] | None:
    """``(objective, where from)`` of a TRL trainer class (or a fullbatch route built on one),
    None when it is not one; raises :class:`Unknown` for the objectives that are no built-in."""
    names = [c.__name__ for c in cls.__mro__ if c.__module__.split(".")[0] == "trl"]
    if "SFTTrainer" in names:
        loss_type = getattr(getattr(trainer, "args", None), "loss_type", "nll") or "nll"
        if loss_type == "nll":
            return "causal_lm", f"{cls.__name__} (loss_type='nll': the next-token mean)"
        raise _declare(cls.__name__, f"SFTConfig(loss_type={loss_type!r}) is no built-in")
    other = next((n for n in names if n in _TRL_OTHERS), None)
    if other is not None:
        loss = getattr(getattr(trainer, "args", None), "loss_type", None)
        shown = f" (loss_type={loss!r})" if loss is not None else ""
        return _refused(cls, f"{other}{shown} trains a loss of its own, not the model head's")
    if names:
        return _refused(cls, "a TRL trainer whose loss the probe does not know")
    return None


def _refused(cls: type, why: str) -> tuple[str, str]:
    raise _declare(cls.__name__, why)


def _hf(cls: type, trainer: Any) -> tuple[str, str] | None:
    """A Hugging Face ``Trainer`` whose loss is not the model head's: refused; else None."""
    from_trainer = [c for c in cls.__mro__ if c.__module__.split(".")[0] == "transformers"]
    base = next((c for c in from_trainer if c.__name__ == "Trainer"), None)
    if base is None:
        return None
    owner = next((c for c in cls.__mro__ if "compute_loss" in c.__dict__), base)
    if owner is not base:
        raise _declare(cls.__name__, f"{owner.__name__} overrides compute_loss")
    if getattr(trainer, "compute_loss_func", None) is not None:
        raise _declare(cls.__name__, "its loss is compute_loss_func")
    smoothing = getattr(getattr(trainer, "args", None), "label_smoothing_factor", 0.0) or 0.0
    if smoothing:
        raise _declare(
            cls.__name__, f"TrainingArguments.label_smoothing_factor={smoothing} smooths the loss"
        )
    return None


def trainer_objective(engine: Engine) -> tuple[str, str] | None:
    """``(objective, where it comes from)`` for the trainer of ``engine``, or None where no
    trainer says (the model's head decides).

    Raises:
        Unknown: a trainer whose objective is no built-in one (module docstring).

    >>> trainer_objective(Engine("a hand-written loop")) is None
    True
    """
    trainer = engine.trainer_object
    if trainer is None or engine.package == "lightning":
        return None
    cls = type(trainer)
    if not any(c.__module__.split(".")[0] == "transformers" for c in cls.__mro__):
        return None  # fb.Accumulator and other routes that are no trainer: the head decides
    if engine.fullbatch:
        loss = getattr(trainer, "fb_loss", None)
        if isinstance(loss, str):
            kind = "token" if loss == "seq2seq" else loss
            return _router(kind, trainer), f"{engine.name}(loss={loss!r})"
        known = _trl(cls, trainer)
        if known is not None:
            return _router(known[0], trainer), engine.name
        why = "its loss is a function" if callable(loss) else "its loss is its exact_loss()"
        raise _declare(engine.name, why)
    known = _trl(cls, trainer)
    if known is not None:
        return _router(known[0], trainer), known[1]
    return _hf(cls, trainer)


def _router(kind: str, trainer: Any) -> str:
    """``causal_lm+moe`` where the trainer's model adds a router aux loss (a transformers MoE
    model: the trainer trains its load balancing too); ``kind`` otherwise."""
    from fullbatch._probe._moe_objective import moe_kind

    model = getattr(trainer, "model", None)
    return moe_kind(kind, model, declared=False) if model is not None else kind

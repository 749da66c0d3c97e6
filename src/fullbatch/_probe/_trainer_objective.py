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
- TRL's ``DPOTrainer`` (and ``fullbatch.trl.ExactDPOTrainer``): ``"dpo"``, TRL's own loss
  summed over the micro-batch's pairs (:mod:`fullbatch.trl._objective`, imported only then),
  where its ``loss_type`` has that form; ``SFTTrainer(loss_type="dft")``: ``"sft_dft"``, its
  per-token loss summed over the targets;
- TRL's other trainers (KTO, ORPO, GRPO, RLOO, reward, ...), DPO settings with no per-pair
  sum, an ``ExactTrainer`` whose loss is a function, a Hugging Face ``Trainer``
  with ``compute_loss_func``, ``label_smoothing_factor`` or an overridden ``compute_loss``: the
  objective cannot be written as one the probe computes: :class:`Unknown` (``fullbatch
  probe`` exits 2 naming the trainer and how to declare it);
- anything else (a loop, a plain ``Trainer``, Lightning): None: the head decides, as before.

TRL's classes are recognised with ``issubclass`` against TRL's own (looked up only where a
class of that name from the ``trl`` package is among the trainer's bases, so nothing new is
imported), any other class from ``trl`` is refused by its name.

On a transformers MoE model whose forward adds its router aux loss, a trainer's
``"causal_lm"`` is ``"causal_lm+moe"`` (:mod:`fullbatch._probe._moe_objective`): the trainer
trains the load balancing too; TRL's ``DPOTrainer`` with its router aux loss on trains
``"dpo+moe"``, its DPO loss plus the load balancing of the window's policy forwards.
"""

from __future__ import annotations

import sys
from typing import Any

from fullbatch._probe._engines import Engine

__all__ = ["ObjectiveUnknown", "Unknown", "trainer_objective"]


class Unknown(ValueError):
    """The objective of the trainer that runs cannot be inferred: the probe will not guess.
    ``trainer``: its class name; ``why``: the reason."""

    def __init__(self, trainer: str, why: str) -> None:
        super().__init__(
            f"objective=None: cannot infer the objective for {trainer}: {why}; declare it: "
            "objective=fn(model, micro) -> (loss_sum, count), the loss summed over the "
            "micro-batch's items (fullbatch probe --objective FILE.py:FN), or a built-in name "
            "where one fits (causal_lm, token, sample). Nothing was trained."
        )
        self.trainer, self.why = trainer, why


class ObjectiveUnknown(ValueError):
    """``objective=None`` on a model whose objective cannot be inferred: raised at its first
    forward, before any backward or step (``module``: its class name)."""

    def __init__(self, message: str, module: str) -> None:
        super().__init__(message)
        self.module = module


def _declare(trainer: str, why: str) -> Unknown:
    return Unknown(trainer, why)


def _from_trl(cls: type) -> list[type]:
    return [c for c in cls.__mro__ if c.__module__.split(".")[0] == "trl"]


def _is_trl(cls: type, name: str) -> bool:
    """Whether ``cls`` is TRL's trainer ``name`` or derives from it."""
    if not any(c.__name__ == name for c in _from_trl(cls)):
        return False
    trl = sys.modules.get("trl")
    try:
        real = getattr(trl, name, None)  # imported already: cls derives from it
    except ImportError:  # pragma: no cover - a TRL that moved the class
        real = None
    return not isinstance(real, type) or issubclass(cls, real)


def _dpo(trainer: Any, name: str) -> tuple[Any, str]:
    from fullbatch.trl._objective import CannotJudge, dpo_objective

    try:
        fn, what = dpo_objective(trainer)
    except CannotJudge as error:
        raise _declare(name, f"DPOTrainer with {error}") from None
    return fn, f"{name} ({what})"


def _trl(cls: type, trainer: Any) -> tuple[Any, str] | None:
    """``(objective, where from)`` of a TRL trainer class (or a fullbatch route built on one),
    None when it is not one; raises :class:`Unknown` for the objectives the probe cannot
    compute."""
    ours = _from_trl(cls)
    if not ours:
        return None
    config = getattr(trainer, "args", None)
    if _is_trl(cls, "SFTTrainer"):
        _settings(cls, trainer)
        loss_type = getattr(config, "loss_type", "nll") or "nll"
        if loss_type == "nll":
            return "causal_lm", f"{cls.__name__} (loss_type='nll': the next-token mean)"
        from fullbatch.trl._objective import sft_objective

        fn, what = sft_objective(trainer)
        return fn, f"{cls.__name__} ({what})"
    if _is_trl(cls, "DPOTrainer"):
        return _dpo(trainer, cls.__name__)
    loss = getattr(config, "loss_type", None)
    shown = f" (loss_type={loss!r})" if loss is not None else ""
    raise _declare(
        cls.__name__,
        f"{ours[0].__name__}{shown} trains a loss of its own, which the probe cannot compute",
    )


def _hf(cls: type, trainer: Any) -> tuple[str, str] | None:
    """A Hugging Face ``Trainer`` whose loss is not the model head's: refused; else None."""
    from_trainer = [c for c in cls.__mro__ if c.__module__.split(".")[0] == "transformers"]
    base = next((c for c in from_trainer if c.__name__ == "Trainer"), None)
    if base is None:
        return None
    owner = next((c for c in cls.__mro__ if "compute_loss" in c.__dict__), base)
    if owner is not base:
        raise _declare(cls.__name__, f"{owner.__name__} overrides compute_loss")
    _settings(cls, trainer)
    return None


def _settings(cls: type, trainer: Any) -> None:
    """Refuse the ``Trainer`` settings that replace or change its loss."""
    if getattr(trainer, "compute_loss_func", None) is not None:
        raise _declare(cls.__name__, "its loss is compute_loss_func")
    smoothing = getattr(getattr(trainer, "args", None), "label_smoothing_factor", 0.0) or 0.0
    if smoothing:
        raise _declare(
            cls.__name__, f"TrainingArguments.label_smoothing_factor={smoothing} smooths the loss"
        )


def trainer_objective(engine: Engine) -> tuple[Any, str] | None:
    """``(objective, where it comes from)`` for the trainer of ``engine`` (a built-in name, or
    ``fn(model, micro) -> (loss_sum, count)`` for TRL's DPO), or None where no trainer says
    (the model's head decides).

    Raises:
        Unknown: a trainer whose objective the probe cannot compute (module docstring).

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
            return _router(known[0], trainer), engine.name + known[1].split(cls.__name__, 1)[-1]
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

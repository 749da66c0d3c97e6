"""Settings a fullbatch TRL trainer refuses, checked before TRL touches the model.

TRL's constructors patch the user's model (a fused LM head, pad and eos token ids), so every
refusal that can be decided from the arguments is made here, before ``super().__init__``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from accelerate.utils import is_peft_model

from fullbatch.hf._settings import refuse_args


def bind(init: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The constructor's arguments by name (``init`` is TRL's ``__init__``, unbound)."""
    bound = inspect.signature(init).bind(None, *args, **kwargs)
    return dict(list(bound.arguments.items())[1:])


def refuse(trainer: str, settings: dict[str, str | None]) -> None:
    """Raise ``ValueError`` for the first setting with a reason (``None``: accepted)."""
    for setting, why in settings.items():
        if why is not None:
            raise ValueError(f"{trainer} refuses {setting}: {why}")


def common(trainer: str, init: Callable[..., Any], args: tuple, kwargs: dict) -> dict[str, Any]:
    """Refuse what every fullbatch Trainer wing refuses, from the arguments of TRL's ``init``;
    those arguments by name."""
    given = bind(init, args, kwargs)
    refuse_args(trainer, given.get("args"), compute_loss_func=given.get("compute_loss_func"))
    return given


def reference(trainer: str, model: Any, peft_config: Any, fix: str) -> None:
    """Refuse, before TRL tries, a reference model TRL would reload from an empty path.

    Without ``ref_model=`` (DPO) or with a KL term (GRPO ``beta != 0``), TRL 1.16 builds the
    frozen reference with ``from_pretrained(model.config._name_or_path)``; a model built from a
    config (``AutoModelForCausalLM.from_config``) has an empty path, and TRL fails deep inside
    ``transformers`` ("Repo id must use alphanumeric chars ...: ''"). A PEFT model needs no
    reference (TRL disables the adapter); a model id string is loaded by TRL itself.
    """
    if model is None or isinstance(model, str) or peft_config is not None:
        return
    config = getattr(model, "config", None)
    if config is None or str(getattr(config, "_name_or_path", "")) or is_peft_model(model):
        return
    raise ValueError(
        f"{trainer}: TRL builds the reference model by reloading "
        f"model.config._name_or_path, which is empty for {type(model).__name__} built from a "
        f"config (not from_pretrained), so it cannot. {fix}"
    )


#: DPO loss types whose per-pair value depends on the other pairs of the batch (sorted across it).
_BATCH_COUPLED = {"aot", "aot_unpaired"}


def dpo(config: Any) -> None:
    """Refuse, before anything is built, DPO settings with no full-batch form."""
    types = getattr(config, "loss_type", ["sigmoid"]) or ["sigmoid"]
    types = [types] if isinstance(types, str) else list(types)
    coupled = sorted(set(types) & _BATCH_COUPLED)
    refuse(
        "ExactDPOTrainer",
        {
            f"loss_type={coupled}": "these losses sort the pairs of a batch against each "
            "other, so no sum over micro-batches equals the full batch's; use another "
            "loss_type or gradient_accumulation_steps=1"
            if coupled
            else None,
            "padding_free=True": "pairs are counted from the padded [chosen; rejected] batch; "
            "set padding_free=False"
            if getattr(config, "padding_free", False)
            else None,
        },
    )

"""Model loading for ``fullbatch verify``: a local Hugging Face checkpoint or ``module:factory``.

Every problem with the user's input becomes an :class:`InputError` whose message is one line
naming the problem and the fix; the CLI prints it without a traceback and exits with code 2.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fullbatch._proof._loader import LoadError, load_function, one_line
from fullbatch._proof._objective import logits_of, objective_loss

__all__ = [
    "InputError",
    "LoadedModel",
    "causal_lm_loss_fn",
    "context_length",
    "load_model",
    "one_line",
]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


#: Bad input to ``fullbatch verify``: the message is one line with the fix (the loader's error).
InputError = LoadError


@dataclass
class LoadedModel:
    """What ``--model`` resolved to."""

    model: nn.Module
    loss_fn: Callable[[nn.Module, Any], tuple[torch.Tensor, Any]] | None
    tokenizer: Any | None
    vocab_size: int | None
    pad_id: int


def _load_checkpoint(path: Path) -> tuple[nn.Module, Any | None]:
    if not (path / "config.json").is_file():
        raise InputError(
            f"--model {path}: no config.json in this directory; pass a Hugging Face checkpoint "
            "saved with model.save_pretrained(path), or module:factory"
        )
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging
    except ImportError as error:
        raise InputError(
            "--model: loading a checkpoint needs transformers: pip install 'fullbatch[hf]'"
        ) from error
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # stderr is for the one-line error
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    except Exception as error:
        raise InputError(
            f"--model {path}: cannot load it with AutoModelForCausalLM ({one_line(error)}); "
            "pass a causal LM checkpoint, or module:factory for other models"
        ) from error
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    tokenizer = None
    if any((path / name).is_file() for name in _TOKENIZER_FILES):
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as error:
            raise InputError(
                f"--model {path}: cannot load its tokenizer ({one_line(error)}); fix or remove "
                "the tokenizer files, or pass token ids as jsonl"
            ) from error
    return model, tokenizer


def _import_factory(spec: str) -> Callable[[], Any]:
    return load_function(
        spec,
        option="--model",
        wanted="a function that returns a model or (model, loss_fn)",
        example="mymodels:make_model",
    )


def _from_factory(spec: str) -> tuple[nn.Module, Any]:
    factory = _import_factory(spec)
    try:
        made = factory()
    except Exception as error:
        raise InputError(f"--model {spec}: the factory raised {one_line(error)}") from error
    model, loss_fn = made if isinstance(made, tuple) and len(made) == 2 else (made, None)
    if not isinstance(model, nn.Module):
        raise InputError(
            f"--model {spec}: the factory returned {type(made).__name__}; it must return a "
            "torch.nn.Module or (model, loss_fn)"
        )
    if loss_fn is not None and not callable(loss_fn):
        raise InputError(
            f"--model {spec}: the factory's loss_fn is a {type(loss_fn).__name__}; it must be "
            "callable as loss_fn(model, micro) -> (loss_sum, count)"
        )
    return model, loss_fn


def _vocab_size(model: nn.Module) -> int | None:
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(size, int):
        return size
    get_embeddings = getattr(model, "get_input_embeddings", None)
    embeddings = get_embeddings() if callable(get_embeddings) else None
    return getattr(embeddings, "num_embeddings", None)


#: config attributes that bound the positions a model can embed, most specific first
_CONTEXT_ATTRIBUTES = ("n_positions", "max_position_embeddings", "n_ctx", "max_seq_len")


def context_length(model: nn.Module) -> tuple[int, str] | None:
    """The model's context from its config, and the attribute it came from (``None``: unknown).

    >>> class Config: n_positions = 1024
    >>> model = torch.nn.Linear(1, 1); model.config = Config()
    >>> context_length(model)
    (1024, 'config.n_positions')
    """
    config = getattr(model, "config", None)
    for attr in _CONTEXT_ATTRIBUTES:
        value = getattr(config, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, f"config.{attr}"
    return None


def load_model(spec: str, *, dtype: torch.dtype | None, device: str) -> LoadedModel:
    """Resolve ``--model``: a checkpoint directory, or ``module:factory`` (``file.py:factory``).

    The model is put in train mode (verify disables dropout itself) and, when ``dtype`` is
    given, cast to it; a checkpoint defaults to float32.

    >>> try:
    ...     load_model("no/such/dir", dtype=None, device="cpu")
    ... except InputError as error:
    ...     print(str(error).split(";")[0])
    --model no/such/dir: no such directory, and not module:factory
    """
    path = Path(spec)
    tokenizer, loss_fn = None, None
    if path.is_dir():
        model, tokenizer = _load_checkpoint(path)
        dtype = dtype or torch.float32
    elif ":" in spec and not path.exists():
        model, loss_fn = _from_factory(spec)
    else:
        what = "is a file" if path.exists() else "no such directory, and not module:factory"
        raise InputError(
            f"--model {spec}: {what}; pass a local Hugging Face checkpoint directory or "
            "module:factory"
        )
    try:
        model = model.to(device=device, dtype=dtype) if dtype else model.to(device)
    except (RuntimeError, AssertionError) as error:
        raise InputError(f"--device {device}: cannot move the model ({one_line(error)})") from error
    model.train()
    config = getattr(model, "config", None)
    pad_id = getattr(config, "pad_token_id", None)
    if pad_id is None and tokenizer is not None:
        pad_id = getattr(tokenizer, "pad_token_id", None)
    return LoadedModel(model, loss_fn, tokenizer, _vocab_size(model), int(pad_id or 0))


def _logits(output: Any, input_ids: torch.Tensor) -> torch.Tensor:
    try:
        logits = logits_of(output)
    except ValueError:
        logits = None
    if not isinstance(logits, torch.Tensor) or logits.shape[:2] != input_ids.shape:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else None
        raise InputError(
            f"the model returned {type(output).__name__}"
            + (f" of shape {shape}" if shape else " without logits")
            + f", expected logits of shape {(*input_ids.shape, 'vocab')}; return logits (or "
            "an output with .logits), or have the factory return (model, loss_fn)"
        )
    return logits


def causal_lm_loss_fn(model: nn.Module, micro: Mapping[str, torch.Tensor]) -> Any:
    """The CLI's default loss: next-token cross-entropy summed over non-padding labels.

    ``micro`` holds right-padded ``input_ids``, ``attention_mask`` and ``labels`` (-100 on
    padding). Models whose forward has no ``input_ids`` argument get the ids positionally.
    """
    input_ids = micro["input_ids"]
    params = inspect.signature(model.forward).parameters
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if "input_ids" in params:
        kwargs = {"input_ids": input_ids}
        if "attention_mask" in params or takes_kwargs:
            kwargs["attention_mask"] = micro["attention_mask"]
        output = model(**kwargs)
    else:
        output = model(input_ids)
    return objective_loss("causal_lm", _logits(output, input_ids), micro["labels"])

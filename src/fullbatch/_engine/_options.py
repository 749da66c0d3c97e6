"""Checking the Accumulator's arguments: every bad value is refused before anything changes,
with the value received and the fix."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = [
    "check_options",
    "check_packing",
    "check_token_keys",
    "check_window_size",
    "trained_params",
]


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
    return value


def trained_params(
    model: nn.Module, optimizer: torch.optim.Optimizer, *, distributed: bool
) -> list[nn.Parameter]:
    """The parameters whose gradients fullbatch normalizes: the model's and the optimizer's.

    A parameter the optimizer steps but the model does not own (a learnable temperature, a
    loss weight) is normalized like the rest; under DDP/FSDP2 it is refused, since the
    wrapper would not reduce its gradient over ranks.
    """
    params = {id(p): p for p in model.parameters() if p.requires_grad}
    owned = set(params)
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if owned and not owned & stepped:
        raise ValueError(
            f"the optimizer holds {len(stepped)} parameter(s) but none of the model's "
            f"{len(owned)} trainable parameters, so training would never change the model. "
            "Build the optimizer from this model's parameters after any copy or wrapping that "
            "replaces them (copy.deepcopy, fully_shard), e.g. "
            "torch.optim.AdamW(model.parameters(), ...)."
        )
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and id(p) not in owned:
                if distributed:
                    raise ValueError(
                        f"the optimizer holds a parameter of shape {tuple(p.shape)} that the "
                        "wrapped model does not own; DDP/FSDP2 would not reduce its gradient "
                        "over ranks. Register it on the model (e.g. as an nn.Parameter "
                        "attribute of a submodule) before wrapping."
                    )
                params[id(p)] = p
    if not params:
        raise ValueError("the model has no parameter with requires_grad=True: nothing to train.")
    return list(params.values())


def check_window_size(
    micro_batches: Any,
    micro_batch_size: Any,
    partial_window: str,
    *,
    micro_batch_tokens: Any = None,
) -> tuple[int | None, int | str | None]:
    """Exactly one of the three window sizes, as positive integers (or ``"auto"`` for the
    micro-batch size); the tail policy with it.

    With ``micro_batch_tokens`` (checked by :func:`check_packing`) the size returned is None.
    """
    given = [micro_batches, micro_batch_size, micro_batch_tokens]
    if sum(v is not None for v in given) != 1:
        raise ValueError(
            "give exactly one of micro_batches=K (the loader yields micro-batches, K per "
            "window), micro_batch_size=M (each loader item is a window, split into rows "
            "of M) or micro_batch_tokens=T (each loader item is a window, cut into "
            f"micro-batches of at most T padded tokens); got micro_batches={micro_batches!r}, "
            f"micro_batch_size={micro_batch_size!r}, micro_batch_tokens={micro_batch_tokens!r}."
        )
    if partial_window not in ("step", "drop"):
        raise ValueError(f"partial_window must be 'step' or 'drop', got {partial_window!r}.")
    if partial_window == "drop" and micro_batches is None:
        raise ValueError(
            "partial_window='drop' works with micro_batches=K only: with micro_batch_size "
            "every loader item is a whole window. Drop short batches in the loader instead "
            "(DataLoader(drop_last=True))."
        )
    if micro_batches is not None:
        return _positive_int("micro_batches", micro_batches), None
    if micro_batch_tokens is not None:
        return None, None
    if micro_batch_size == "auto":
        return None, "auto"
    return None, _positive_int("micro_batch_size", micro_batch_size)


def check_packing(
    micro_batch_size: Any, micro_batch_tokens: Any, sort_rows: Any, lengths: Any
) -> int | str | None:
    """The length-aware options (after :func:`check_window_size`); the token budget or None."""
    if not isinstance(sort_rows, bool):
        raise ValueError(f"sort_rows must be True or False, got {sort_rows!r}.")
    if sort_rows and micro_batch_size is None:
        raise ValueError(
            "sort_rows=True sorts each window's rows by length before cutting it into "
            "micro_batch_size=M rows; give micro_batch_size=M with it (micro_batch_tokens=T "
            f"always sorts, micro_batches=K never splits); got micro_batch_size=None, "
            f"micro_batch_tokens={micro_batch_tokens!r}."
        )
    if not (isinstance(lengths, str) or callable(lengths)):
        raise ValueError(
            f"lengths must be a key of the loader item (e.g. 'attention_mask') or a callable "
            f"fn(item) -> 1-D integer tensor of row lengths, got {lengths!r}."
        )
    if lengths != "attention_mask" and not sort_rows and micro_batch_tokens is None:
        raise ValueError(
            f"lengths={lengths!r} is used only to sort and trim rows: give "
            "micro_batch_tokens=T, or micro_batch_size=M with sort_rows=True."
        )
    if micro_batch_tokens is None or micro_batch_tokens == "auto":
        return micro_batch_tokens
    return _positive_int("micro_batch_tokens", micro_batch_tokens)


def check_token_keys(
    token_keys: Any, micro_batch_tokens: Any, sort_rows: bool
) -> frozenset[str] | None:
    """``token_keys``: None, or the names of the per-token keys (trimmed or packed)."""
    if token_keys is None:
        return None
    if isinstance(token_keys, str) or not all(isinstance(k, str) for k in token_keys):
        raise ValueError(
            f"token_keys must be a collection of key names, e.g. ('input_ids', "
            f"'attention_mask', 'labels'), got {token_keys!r}."
        )
    if micro_batch_tokens is None and not sort_rows:
        raise ValueError(
            f"token_keys={tuple(token_keys)!r} names the per-token tensors that are trimmed "
            "or packed: give micro_batch_tokens=T, or micro_batch_size=M with sort_rows=True."
        )
    return frozenset(token_keys)


def check_options(
    *, max_grad_norm: Any, counts: Any, batchnorm: Any, padding_micro_batch: Any
) -> None:
    if max_grad_norm is not None and not (0 < float(max_grad_norm) < float("inf")):
        raise ValueError(f"max_grad_norm must be a finite number > 0, got {max_grad_norm!r}.")
    if counts is not None:
        if not isinstance(counts, Mapping) or not all(callable(f) for f in counts.values()):
            raise ValueError(
                f"counts must map names to functions of a micro-batch, got {counts!r}; "
                "e.g. counts={'tokens': lambda m: fb.count_tokens(m['labels'])}."
            )
    if batchnorm not in (None, "window"):
        raise ValueError(f"batchnorm must be None or 'window', got {batchnorm!r}.")
    if padding_micro_batch is not None and not callable(padding_micro_batch):
        raise ValueError("padding_micro_batch must be a callable returning a micro-batch.")

"""The demo's model and tokenizer: a tiny seeded Llama, or a local Hugging Face checkpoint.

Both come back in evaluation mode: dropout off, so that every arm computes the same function
and gradients differ only by how each recipe normalizes them (and by rounding).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from fullbatch._demo._corpus import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, encode_bytes

__all__ = ["LoadedModel", "load_local", "tiny_llama"]


@dataclass
class LoadedModel:
    """A causal LM with the function that turns text into its token ids.

    Attributes:
        model: the causal LM, in eval mode.
        encode: text -> token ids, already cut to the maximum length.
        pad_id: the id written at padding positions (masked, and ``-100`` in the labels).
        description: one line naming the model for the report.
    """

    model: torch.nn.Module
    encode: Callable[[str], Sequence[int]]
    pad_id: int
    description: str


def tiny_llama(*, seed: int, max_length: int, dtype: torch.dtype) -> LoadedModel:
    """A 2-layer Llama (hidden 64, 4 heads) over bytes, randomly initialized from ``seed``.

    The global random state is left as it was.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=max_length,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        attention_dropout=0.0,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    # transformers decorates .to in a way type checkers misread; it is nn.Module.to.
    model.to(dtype=dtype).eval()  # type: ignore[call-arg]
    count = sum(p.numel() for p in model.parameters())
    return LoadedModel(
        model=model,
        encode=functools.partial(encode_bytes, max_length=max_length),
        pad_id=PAD_ID,
        description=f"tiny Llama, {count / 1e3:.0f}k parameters, byte-level, seed {seed}",
    )


def _encode_with(tokenizer: object, text: str, *, max_length: int) -> list[int]:
    ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])  # type: ignore[operator]
    bos = getattr(tokenizer, "bos_token_id", None)
    eos = getattr(tokenizer, "eos_token_id", None)
    if bos is not None and (not ids or ids[0] != bos):
        ids.insert(0, bos)
    if eos is not None and ids[-1] != eos:
        ids.append(eos)
    return ids[:max_length]


def load_local(path: str | Path, *, max_length: int, dtype: torch.dtype) -> LoadedModel:
    """A causal LM and its tokenizer from a local directory; nothing is downloaded.

    Raises:
        ValueError: ``path`` is not a directory holding a causal LM and its tokenizer.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not path.is_dir():
        raise ValueError(
            f"--model {str(path)!r} is not a directory; pass a local Hugging Face checkpoint "
            "(a folder with config.json, the weights and the tokenizer files)"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"could not load a causal LM and its tokenizer from {str(path)!r}: {first_line}; "
            "save both there with model.save_pretrained(dir) and tokenizer.save_pretrained(dir)"
        ) from exc
    # transformers decorates .to in a way type checkers misread; it is nn.Module.to.
    model.to(dtype=dtype).eval()  # type: ignore[call-arg]
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    count = sum(p.numel() for p in model.parameters())
    return LoadedModel(
        model=model,
        encode=functools.partial(_encode_with, tokenizer, max_length=max_length),
        pad_id=int(pad_id),
        description=f"{path.name} ({type(model).__name__}, {count / 1e6:.1f}M parameters)",
    )

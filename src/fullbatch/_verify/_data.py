"""Data for ``fullbatch verify``: read examples from jsonl or text, pad them into one batch.

- ``.jsonl`` / ``.json`` / ``.ndjson``: one example per line, a list of token ids or an object
  ``{"input_ids": [...], "labels": [...]}`` (``labels`` optional, ``-100`` to ignore a token);
  a ``.json`` file may also hold one JSON array of such examples.
- anything else is plain text, one example per line, tokenized with the checkpoint's tokenizer
  when it has one, else byte-level (each UTF-8 byte is a token id, so the vocabulary needs
  at least 256 ids).

Rows are right-padded: ``attention_mask`` 0 and ``labels`` -100 on padding, so padding never
counts as an item.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

import torch

from fullbatch._verify._load import InputError

__all__ = ["Example", "collate", "read_examples", "require_file", "truncate"]

_JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
_FORMAT = 'a list of token ids or {"input_ids": [...]}'


@dataclass(frozen=True)
class Example:
    """One row: token ids and, optionally, labels aligned with them."""

    input_ids: list[int]
    labels: list[int] | None = None


def _int_list(value: Any) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    )


def _parse_json_line(text: str, where: str) -> Example:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise InputError(
            f"{where}: not valid JSON ({error.msg} at column {error.colno}); each line must be "
            f"{_FORMAT}"
        ) from error
    return _parse_json_value(value, where)


def _json_array(text: str) -> list[Any] | None:
    """The items of a file that is one JSON array of examples (not of ints); else ``None``."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if isinstance(value, list) and not _int_list(value):
        return value
    return None


def _parse_json_value(value: Any, where: str) -> Example:
    if isinstance(value, dict):
        ids, labels = value.get("input_ids"), value.get("labels")
        if not _int_list(ids):
            raise InputError(
                f'{where}: "input_ids" must be a list of integers; each line is {_FORMAT}'
            )
        if labels is not None and not (_int_list(labels) and len(labels) == len(ids)):
            raise InputError(
                f'{where}: "labels" must be a list of {len(ids)} integers like "input_ids" '
                "(-100 for ignored tokens), or left out"
            )
        return Example(ids, labels)
    if not _int_list(value):
        raise InputError(f"{where}: got {type(value).__name__}, expected {_FORMAT}")
    return Example(value)


def _check_ids(example: Example, where: str, vocab_size: int | None) -> None:
    if not example.input_ids:
        raise InputError(f"{where}: empty example; remove the line or give it tokens")
    bad = [t for t in example.input_ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if bad:
        limit = f"0..{vocab_size - 1}" if vocab_size is not None else "non-negative ids"
        raise InputError(
            f"{where}: token id {bad[0]} is outside the model's vocabulary ({limit}); "
            "tokenize with the model's tokenizer"
        )


def require_file(path: str) -> Path:
    """``path`` as a ``Path``; :class:`InputError` naming the fix when it is not a file."""
    file = Path(path)
    if not file.is_file():
        what = "is a directory" if file.is_dir() else "no such file"
        raise InputError(
            f"--data {path}: {what}; pass a .jsonl file of token ids or a text file with one "
            "example per line"
        )
    return file


def read_examples(path: str, *, tokenizer: Any | None, vocab_size: int | None) -> list[Example]:
    """Read every non-blank line of ``path`` as one example, with errors naming the line.

    >>> import tempfile, os
    >>> with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
    ...     _ = f.write('[1, 2, 3]\\n{"input_ids": [4, 5]}\\n')
    >>> [e.input_ids for e in read_examples(f.name, tokenizer=None, vocab_size=10)]
    [[1, 2, 3], [4, 5]]
    >>> os.remove(f.name)
    """
    file = require_file(path)
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise InputError(f"--data {path}: cannot read it as UTF-8 text ({error})") from error
    as_json = file.suffix.lower() in _JSON_SUFFIXES
    if not as_json and tokenizer is None and vocab_size is not None and vocab_size < 256:
        raise InputError(
            f"--data {path}: byte-level tokenization of text needs a vocabulary of at least 256 "
            f"ids, the model has {vocab_size}; pass token ids as .jsonl, or save a tokenizer in "
            "the checkpoint directory"
        )
    examples = []
    items = _json_array("\n".join(lines)) if file.suffix.lower() == ".json" else None
    for number, item in enumerate(items or [], start=1):
        example = _parse_json_value(item, f"{path} item {number}")
        _check_ids(example, f"{path} item {number}", vocab_size)
        examples.append(example)
    for number, line in enumerate([] if items is not None else lines, start=1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        if as_json:
            example = _parse_json_line(line, where)
        elif tokenizer is not None:
            example = Example(list(tokenizer(line)["input_ids"]))
        else:
            example = Example(list(line.encode("utf-8")))
        _check_ids(example, where, vocab_size)
        examples.append(example)
    return examples


def truncate(examples: list[Example], max_length: int) -> tuple[list[Example], int]:
    """Every example cut to its first ``max_length`` tokens, and how many were longer.

    >>> truncate([Example([1, 2, 3]), Example([4])], 2)
    ([Example(input_ids=[1, 2], labels=None), Example(input_ids=[4], labels=None)], 1)
    """
    cut = [
        Example(e.input_ids[:max_length], None if e.labels is None else e.labels[:max_length])
        for e in examples
    ]
    return cut, sum(len(e.input_ids) > max_length for e in examples)


def collate(examples: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad examples into ``input_ids``, ``attention_mask`` and ``labels`` (-100 on pads).

    >>> batch = collate([Example([1, 2, 3]), Example([4])], pad_id=0)
    >>> batch["input_ids"].tolist(), batch["labels"].tolist()
    ([[1, 2, 3], [4, 0, 0]], [[1, 2, 3], [4, -100, -100]])
    """
    width = max(len(e.input_ids) for e in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, example in enumerate(examples):
        length = len(example.input_ids)
        input_ids[row, :length] = torch.tensor(example.input_ids)
        labels[row, :length] = torch.tensor(
            example.input_ids if example.labels is None else example.labels
        )
        mask[row, :length] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}

"""Real variable-length text found on every machine with Python: the standard library's docstrings.

The files are read with :mod:`ast`, never imported, so reading them runs no code. Test suites,
IDLE and installed packages are left out: what remains is prose written by people, of every
length from one line to a page, which is what makes naive accumulation go wrong.

>>> from fullbatch._demo._corpus import encode_bytes
>>> encode_bytes("hi", max_length=8)
[256, 104, 105, 257]
"""

from __future__ import annotations

import ast
import hashlib
import os
import random
import sysconfig
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "EXCLUDED_DIRS",
    "IGNORE_INDEX",
    "PAD_ID",
    "VOCAB_SIZE",
    "Corpus",
    "docstrings",
    "encode_bytes",
    "make_batches",
    "read_corpus",
    "source_files",
    "stdlib_root",
]

# Byte-level vocabulary: ids 0..255 are the UTF-8 bytes themselves.
BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
VOCAB_SIZE = 259
IGNORE_INDEX = -100

EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idle_test", "idlelib", "site-packages", "dist-packages", "__pycache__"}
)

_DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def stdlib_root() -> Path:
    """The directory of this interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path) -> list[Path]:
    """Every ``.py`` file under ``root``, sorted, outside :data:`EXCLUDED_DIRS`."""
    found: list[Path] = []
    for directory, subdirs, names in os.walk(root):
        # Pruning in place stops os.walk from descending into excluded directories.
        subdirs[:] = sorted(d for d in subdirs if d not in EXCLUDED_DIRS)
        found.extend(Path(directory, n) for n in sorted(names) if n.endswith(".py"))
    return found


def docstrings(path: Path) -> list[str]:
    """Docstrings of the module, classes and functions in ``path``, in source order.

    A file that cannot be read or parsed by this interpreter yields no docstrings.
    """
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (OSError, SyntaxError, ValueError):
        return []
    texts = []
    for node in ast.walk(tree):
        if isinstance(node, _DOCUMENTED):
            text = ast.get_docstring(node, clean=True)
            if text and text.strip():
                texts.append(text)
    return texts


def encode_bytes(text: str, *, max_length: int) -> list[int]:
    """``[BOS] + UTF-8 bytes + [EOS]``, cut to ``max_length`` tokens."""
    return [BOS_ID, *text.encode("utf-8"), EOS_ID][:max_length]


@dataclass(frozen=True)
class Corpus:
    """Token rows in training order, with what is needed to say where they came from.

    Attributes:
        texts: the docstrings, in training order.
        rows: their token ids (each at least two tokens, so at least one predicted token).
        files: how many source files were parsed.
        digest: first 12 hex digits of the SHA-256 of ``texts`` in order; equal digests mean
            identical training text (it changes with the Python version and ``seed``).
    """

    texts: tuple[str, ...]
    rows: tuple[tuple[int, ...], ...]
    files: int
    digest: str


def read_corpus(
    n: int,
    *,
    seed: int,
    encode: Callable[[str], Sequence[int]],
    root: Path | None = None,
) -> Corpus:
    """``n`` docstrings from the standard library, shuffled with ``seed``, and their tokens.

    Files are visited in a seeded random order and parsed only until ``n`` usable docstrings
    are found, so a short run parses a few dozen files rather than the whole library. If the
    library holds fewer than ``n``, it is repeated, reshuffled each time.

    Raises:
        ValueError: ``n`` is not positive, or ``root`` holds no usable docstring.
    """
    if n < 1:
        raise ValueError(f"need at least one docstring, got n={n}")
    root = stdlib_root() if root is None else root
    rng = random.Random(seed)
    files = source_files(root)
    rng.shuffle(files)
    pool: list[tuple[str, tuple[int, ...]]] = []
    parsed = 0
    for path in files:
        if len(pool) >= n:
            break
        parsed += 1
        for text in docstrings(path):
            ids = tuple(encode(text))
            if len(ids) >= 2:
                pool.append((text, ids))
    if not pool:
        raise ValueError(
            f"found no docstring in the {len(files)} .py files under {root}; "
            "pass root= a directory of Python sources"
        )
    chosen: list[tuple[str, tuple[int, ...]]] = []
    while len(chosen) < n:
        epoch = pool[:]
        rng.shuffle(epoch)
        chosen.extend(epoch[: n - len(chosen)])
    texts = tuple(text for text, _ in chosen)
    digest = hashlib.sha256("\0".join(texts).encode("utf-8")).hexdigest()[:12]
    return Corpus(texts, tuple(ids for _, ids in chosen), parsed, digest)


def make_batches(
    rows: Sequence[Sequence[int]], *, batch_size: int, pad_id: int
) -> list[dict[str, torch.Tensor]]:
    """Consecutive rows grouped into batches, right-padded to each batch's longest row.

    Each batch has ``input_ids``, ``attention_mask`` and ``labels`` of shape
    ``[batch_size, longest]``; labels are the input ids, with ``-100`` at padding. A last group
    smaller than ``batch_size`` is dropped.
    """
    batches = []
    for start in range(0, len(rows) - batch_size + 1, batch_size):
        group = rows[start : start + batch_size]
        width = max(len(r) for r in group)
        input_ids = torch.full((batch_size, width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((batch_size, width), dtype=torch.long)
        for i, row in enumerate(group):
            input_ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            attention_mask[i, : len(row)] = 1
        labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
        batches.append({"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels})
    return batches

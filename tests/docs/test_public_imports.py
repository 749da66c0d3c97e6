"""The docs, the README and the examples import only fullbatch's public modules and names.

A user copies the examples: an import of ``fullbatch._something`` (or of a ``_name`` from a
public module) would tie their code to a private module that may move in any release.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Pages for contributors who write a wing inside the package: they import its private modules
# as the wings do, and say so at the top.
CONTRIBUTORS = {"wings.md"}
PAGES = [
    *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name not in CONTRIBUTORS),
    ROOT / "README.md",
]
SCRIPTS = sorted((ROOT / "examples").glob("*.py"))

# Any import statement in a page's text (every fence kind, prose too): `from fullbatch._x`,
# `import fullbatch._x`, `from fullbatch.hf import _private`, `import_module("fullbatch._x")`.
IMPORT_TEXT = re.compile(
    r"(?:\bfrom\s+fullbatch(?:\.\w+)*\._\w*"
    r"|\bimport\s+fullbatch(?:\.\w+)*\._\w*"
    r"|\bfrom\s+fullbatch(?:\.\w+)*\s+import\s+\(?\s*(?:\w+\s*,\s*)*_\w*"
    r"|import_module\(\s*[\"']fullbatch(?:\.\w+)*\._)"
)


def _private_imports_in_code(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("fullbatch")]
            found += [n for n in names if any(p.startswith("_") for p in n.split("."))]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fullbatch"):
            module = node.module or ""
            if any(p.startswith("_") for p in module.split(".")):
                found.append(module)
            found += [f"{module}.{a.name}" for a in node.names if a.name.startswith("_")]
    return found


def private_imports(text: str) -> list[str]:
    """Every private fullbatch import in a Markdown page's text or a script."""
    return [m.group(0) for m in IMPORT_TEXT.finditer(text)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_pages_import_no_private_module(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    lines = [
        f"{page.name}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
        for m in IMPORT_TEXT.finditer(text)
    ]
    assert lines == [], "use a public name (e.g. fullbatch.testing.tiny_causal_lm)"


@pytest.mark.parametrize("name", sorted(CONTRIBUTORS))
def test_contributor_pages_say_they_use_private_modules(name: str) -> None:
    head = (ROOT / "docs" / name).read_text(encoding="utf-8")[:1500]
    assert "For contributors" in head and "private" in head


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_examples_import_no_private_module(script: Path) -> None:
    tree = ast.parse(script.read_text(encoding="utf-8"))
    assert _private_imports_in_code(tree) == []


@pytest.mark.parametrize(
    "line",
    [
        "from fullbatch._demo._trl_tiny import tiny_causal_lm",
        "import fullbatch._engine._accumulator as acc",
        "from fullbatch.hf import _normalize",
        "from fullbatch.testing import (tiny_causal_lm, _dtype_kwargs)",
        'importlib.import_module("fullbatch._verify")',
    ],
)
def test_the_scan_sees_a_private_import(line: str) -> None:
    assert private_imports(f"text\n{line}\n") != []
    assert _private_imports_in_code(ast.parse(line)) != [] or "import_module" in line


@pytest.mark.parametrize(
    "line",
    [
        "from fullbatch.testing import char_tokenizer, tiny_causal_lm",
        "import fullbatch.trl",
        "from fullbatch.hf import ExactTrainer",
        "import fullbatch as fb",
    ],
)
def test_the_scan_passes_a_public_import(line: str) -> None:
    assert private_imports(line) == []
    assert _private_imports_in_code(ast.parse(line)) == []


def test_the_tiny_builders_are_public() -> None:
    import fullbatch.testing

    assert {"char_tokenizer", "tiny_causal_lm", "tiny_seq2seq"} <= set(fullbatch.testing.__all__)
    assert all(
        not name.startswith("_") and getattr(fullbatch.testing, name)
        for name in fullbatch.testing.__all__
    )

"""Every package's docstring names exactly its modules (the maps do not drift).

A package's docstring is its map: each of its private modules and sub-packages is named there
as ````_name```` (what it does beside it), and every ````_name```` it names exists. The
top-level ``fullbatch`` package names its private packages too, and holds no loose private
module: every private module lives in a package whose map names it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import fullbatch

ROOT = Path(fullbatch.__file__).parent
PACKAGES = sorted(p.parent for p in ROOT.rglob("__init__.py"))
NAMED = re.compile(r"``(_[A-Za-z0-9_]+)``")


def modules(package: Path) -> set[str]:
    """The package's private modules and sub-packages."""
    files = {p.stem for p in package.glob("_*.py") if p.name not in ("__init__.py", "__main__.py")}
    subpackages = {p.parent.name for p in package.glob("_*/__init__.py")}
    return files | subpackages


def named(package: Path) -> set[str]:
    docstring = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    return set(NAMED.findall(docstring))


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.relative_to(ROOT).as_posix() or ".")
def test_docstring_names_exactly_the_modules(package: Path) -> None:
    real, listed = modules(package), named(package)
    assert listed - real == set(), f"named in the docstring, but no such module: {listed - real}"
    assert real - listed == set(), f"modules the docstring does not name: {real - listed}"


def test_the_top_level_holds_no_loose_private_module() -> None:
    """Private code lives in a package with a map (``_wings``, ``hf``, ``_pipeline``, ...)."""
    loose = sorted(
        p.name for p in ROOT.glob("_*.py") if p.name not in ("__init__.py", "__main__.py")
    )
    assert loose == [], f"private modules loose at the top level: {loose}"


def test_the_map_check_can_fail(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text('"""Modules: ``_a`` and ``_gone``."""\n')
    (package / "_a.py").write_text("")
    (package / "_b.py").write_text("")
    assert modules(package) == {"_a", "_b"}
    assert named(package) == {"_a", "_gone"}
    assert ROOT in PACKAGES and all((p / "__init__.py").exists() for p in PACKAGES)

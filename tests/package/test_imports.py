"""Imports run one way: a walk over every ``import`` in ``src/fullbatch`` (ast, not runtime).

Counted: module-level imports, imports under ``if TYPE_CHECKING:`` and imports inside
functions. The floors: ``_base`` (leaves) < ``_engine`` and ``_proof`` (the proof core,
which imports ``_base`` alone) < wings (``_verify``, ``_probe``, ``_demo``) and public
modules (``hf``, ``lightning``, ``trl``, ``testing``, ``cli``).
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest

import fullbatch

ROOT = Path(fullbatch.__file__).parent

# Function-local imports keep `fullbatch --help` (and `import fullbatch`) light: the CLI and
# the wings it starts, whose optional dependencies (transformers, matplotlib, tqdm) load late.
LAZY_OK = ("fullbatch.cli", "fullbatch._verify", "fullbatch._demo", "fullbatch._probe")
MAX_CODE_LINES = 300


def _name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolve(target: str) -> str | None:
    """The fullbatch module ``target`` names (or its nearest package), None outside fullbatch."""
    while target:
        if target in MODULES:
            return target
        if "." not in target:
            return None
        target = target.rsplit(".", 1)[0]
    return None


def _imports(name: str) -> list[tuple[str, int, bool, str]]:
    """``(imported module, line, function-local, raw target)`` for every import in ``name``."""
    path = MODULES[name]
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: list[tuple[str, int, bool, str]] = []

    def visit(node: ast.AST, local: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = local or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            if isinstance(child, ast.Import):
                for alias in child.names:
                    found.append((alias.name, child.lineno, inner, alias.name))
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(up + ([base] if base else []))
                for alias in child.names:
                    found.append((f"{base}.{alias.name}", child.lineno, inner, base))
            visit(child, inner)

    visit(tree, False)
    return found


EDGES = {
    name: sorted({m for target, _, _, _ in _imports(name) if (m := _resolve(target)) and m != name})
    for name in MODULES
}


def _cycles() -> list[list[str]]:
    """Strongly connected components with more than one module (or a self-loop)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in EDGES[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in MODULES:
        if v not in index:
            connect(v)
    return out


def test_no_import_cycle() -> None:
    assert _cycles() == [], "import cycles (type-only and function-local imports counted)"


def test_the_walk_sees_type_only_and_function_local_imports() -> None:
    """The walk is not blind: it finds the kinds of import a cycle would hide behind."""
    edges = EDGES["fullbatch"]
    assert "fullbatch._engine._accumulator" in edges  # under `if TYPE_CHECKING:`
    local = [(t, line) for t, line, inner, _ in _imports("fullbatch._verify._cli") if inner]
    assert any(t.startswith("fullbatch._verify._run") for t, _ in local), local


def _floor(name: str) -> int:
    if name.startswith("fullbatch._base"):
        return 0
    if name.startswith("fullbatch._engine"):
        return 1
    return 2  # wings and public modules


def test_floors_import_downwards() -> None:
    up = [
        f"{name} -> {target}"
        for name, targets in EDGES.items()
        for target in targets
        if _floor(target) > _floor(name) and name != "fullbatch"
    ]
    assert up == [], "a leaf imports the engine, or the engine imports a wing"


def test_the_proof_core_imports_the_leaves_alone() -> None:
    """``_proof`` is shared by verify, the probe and the wings: it never loads the engine."""
    above = [
        f"{name} -> {target}"
        for name, targets in EDGES.items()
        if name.startswith("fullbatch._proof")
        for target in targets
        if not target.startswith(("fullbatch._base", "fullbatch._proof"))
    ]
    assert above == []
    assert any(t.startswith("fullbatch._base") for t in EDGES["fullbatch._proof._objective"])


def test_the_probe_imports_no_wing() -> None:
    """The probe reads what it needs of DeepSpeed (``refusal``) and of meshes from the floor:
    none of its modules, function-local imports included, loads the wings' floor ``_wings``."""
    wings = [
        f"{name}:{line} imports {target}"
        for name in MODULES
        if name.startswith("fullbatch._probe")
        for target, line, _, _ in _imports(name)
        if target.startswith("fullbatch._wings")
    ]
    assert wings == []


def test_function_local_imports_only_where_the_cli_stays_light() -> None:
    local = [
        f"{name}:{line} imports {target}"
        for name in MODULES
        if not name.startswith(LAZY_OK)
        for target, line, inner, _ in _imports(name)
        if inner
    ]
    assert local == []


def test_only_sync_imports_torch_distributed() -> None:
    offenders = []
    for name, path in MODULES.items():
        if name == "fullbatch._base._sync" or name.startswith("fullbatch._base._sync."):
            continue  # the _sync package: its modules are the only importers
        for target, line, _, base in _imports(name):
            if base.startswith("torch.distributed") or target.startswith("torch.distributed"):
                offenders.append(f"{name}:{line}")
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "distributed"
                and isinstance(node.value, ast.Name)
                and node.value.id == "torch"
            ):
                offenders.append(f"{name}:{node.lineno} (torch.distributed attribute)")
    assert offenders == []


def code_lines(path: Path) -> int:
    """Lines holding code: not blank, not only a comment, not inside a docstring."""
    source = path.read_text()
    docstring_lines: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                if isinstance(body[0].value.value, str):
                    end = body[0].end_lineno or body[0].lineno
                    docstring_lines.update(range(body[0].lineno, end + 1))
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT):
            continue
        if tok.type in (tokenize.DEDENT, tokenize.ENDMARKER):
            continue
        lines.update(range(tok.start[0], tok.end[0] + 1))
    return len(lines - docstring_lines)


def test_code_lines_counts_code_only(tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text(
        '"""Doc.\n\nmore doc\n"""\n\n# a comment\nx = 1\n\n\ndef f():\n    """D."""\n    return x\n'
    )
    assert code_lines(path) == 3  # x = 1, def f():, return x


@pytest.mark.parametrize("name", sorted(MODULES))
def test_modules_stay_small(name: str) -> None:
    assert code_lines(MODULES[name]) <= MAX_CODE_LINES


def test_public_classes_live_at_fullbatch() -> None:
    """Reprs and pickles name ``fullbatch.X``, whichever file defines X."""
    classes = [getattr(fullbatch, n) for n in fullbatch.__all__]
    classes = [c for c in classes if isinstance(c, type)]
    assert classes and all(c.__module__ == "fullbatch" for c in classes), [
        (c.__name__, c.__module__) for c in classes
    ]

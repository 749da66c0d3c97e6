"""Every Python example in ``docs/*.md`` and ``README.md`` runs, and the docs' links resolve.

Fences, by info string:

- ```` ```python ````: executed in this process. The blocks of one page run in order in one
  namespace, so a page can build a model in one block and train it in the next. Selecting a
  single block (``-k``) runs the page's earlier blocks first.
- ```` ```python torchrun ```` (optionally ``nproc=4``): a whole script, written to a file and
  launched with ``python -m torch.distributed.run --standalone --nproc-per-node 2`` on CPU
  (gloo); it must exit with status 0. Such scripts assert their own claims.
- ```` ```python no-run ````: compiled, not run. Only for third-party snippets (Accelerate's)
  and fragments that need a launcher or hardware this machine lacks.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
DOC_PAGES = sorted(DOCS.glob("*.md"))
PAGES = [*DOC_PAGES, ROOT / "README.md"]
TAGS = {"no-run", "torchrun"}
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
TORCHRUN_TIMEOUT = 120


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the first code line
    info: str
    code: str

    @property
    def language(self) -> str:
        return self.info.split()[0] if self.info.split() else ""

    @property
    def tags(self) -> list[str]:
        return self.info.split()[1:]

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def mode(self) -> str:
        if "no-run" in self.tags:
            return "no-run"
        if "torchrun" in self.tags:
            return "torchrun"
        return "run"

    @property
    def nproc(self) -> int:
        for tag in self.tags:
            if tag.startswith("nproc="):
                return int(tag.split("=", 1)[1])
        return 2

    def compiled(self) -> Any:
        # Leading newlines make tracebacks point at the Markdown file's own line numbers.
        return compile("\n" * (self.line - 1) + self.code, str(self.page), "exec")


def fences(page: Path) -> list[Block]:
    """Every fenced block of ``page`` (any language), with its info string."""
    blocks: list[Block] = []
    lines = page.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        body: list[str] = []
        j = i + 1
        while j < len(lines):
            closing = FENCE.match(lines[j])
            if closing and closing["fence"].startswith(fence) and not closing["info"].strip():
                break
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j])
            j += 1
        code = textwrap.dedent("\n".join(body)) + "\n"
        blocks.append(Block(page, i + 2, opening["info"].strip(), code))
        i = j + 1
    return blocks


def python_blocks(page: Path) -> list[Block]:
    return [b for b in fences(page) if b.language == "python"]


ALL_PYTHON = [b for page in PAGES if page.exists() for b in python_blocks(page)]


# -- in-process blocks: one namespace per page, blocks in order ------------------------------


@dataclass
class PageState:
    namespace: dict[str, Any]
    done: int = 0  # blocks of the page already run
    failed: str | None = None  # id of the block that failed


_STATES: dict[Path, PageState] = {}


def _run_in_page(block: Block) -> None:
    runnable = [b for b in python_blocks(block.page) if b.mode == "run"]
    state = _STATES.setdefault(block.page, PageState({"__name__": "__docs__"}))
    index = runnable.index(block)
    if importlib.util.find_spec("transformers") is None and any(
        "from transformers import" in b.code for b in runnable[: index + 1]
    ):
        pytest.skip("needs transformers (pip install -e '.[hf]')")
    if (
        state.failed is not None
        and runnable.index(next(b for b in runnable if b.id == state.failed)) < index
    ):
        pytest.fail(f"an earlier block of this page failed: {state.failed}", pytrace=False)
    while state.done <= index:
        current = runnable[state.done]
        state.done += 1
        try:
            exec(current.compiled(), state.namespace)
        except BaseException:
            state.failed = current.id
            if current.id != block.id:
                pytest.fail(f"an earlier block of this page failed: {current.id}", pytrace=False)
            raise


def _run_torchrun(block: Block, tmp_path: Path) -> None:
    script = tmp_path / f"{block.page.stem}_{block.line}.py"
    script.write_text(block.code, encoding="utf-8")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(block.nproc),
        str(script),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=TORCHRUN_TIMEOUT,
            cwd=tmp_path,
            env=env,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{block.id}: torchrun did not finish in {TORCHRUN_TIMEOUT} s\n{exc}")
    if proc.returncode != 0:
        output = (proc.stdout + proc.stderr)[-6000:]
        pytest.fail(f"{block.id}: torchrun exited with {proc.returncode}\n{output}")


@pytest.mark.timeout(TORCHRUN_TIMEOUT + 60)
@pytest.mark.parametrize("block", ALL_PYTHON, ids=[b.id for b in ALL_PYTHON])
def test_python_example_runs(block: Block, tmp_path: Path) -> None:
    block.compiled()  # every block, run or not, is valid Python
    if block.mode == "no-run":
        pytest.skip("marked no-run: compiled, not executed")
    if block.mode == "torchrun":
        _run_torchrun(block, tmp_path)
    else:
        _run_in_page(block)


# -- the fences and links themselves ---------------------------------------------------------


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_fences_are_known(page: Path) -> None:
    """A typo in an info string (```py, ```python norun) must not silently skip an example."""
    for block in fences(page):
        if block.language.startswith("py") and block.language != "python":
            pytest.fail(f"{block.id}: write ```python, not ```{block.language}")
        if block.language == "python":
            unknown = [t for t in block.tags if t not in TAGS and not t.startswith("nproc=")]
            assert not unknown, f"{block.id}: unknown fence tags {unknown}; known: {sorted(TAGS)}"


def test_docs_pages_exist() -> None:
    names = {p.name for p in DOC_PAGES}
    pages = ("index", "quickstart", "concepts", "distributed", "migrating", "faq")
    assert {f"{name}.md" for name in pages} <= names
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    for name in pages[1:]:
        assert f"]({name}.md)" in index, f"index.md does not link {name}.md"


LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(?P<title>.+?)\s*#*\s*$")


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    code = {n for b in fences(page) for n in range(b.line, b.line + b.code.count("\n"))}
    out = set()
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1):
        match = HEADING.match(line)
        if match and number not in code:
            slug = re.sub(r"[^\w\- ]", "", match["title"].lower()).replace(" ", "-")
            out.add(slug)
    return out


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    for match in LINK.finditer(text):
        target = match["target"]
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = page.parent / path if path else page
        assert file.exists(), f"{page.name}: broken link {target}"
        if anchor and file.suffix == ".md":
            assert anchor in anchors(file), f"{page.name}: no heading #{anchor} in {file.name}"


@pytest.mark.parametrize("page", DOC_PAGES, ids=[str(p.relative_to(ROOT)) for p in DOC_PAGES])
def test_python_examples_fit_the_line_length(page: Path) -> None:
    """Examples follow the project's line length (100), so they read well and paste cleanly."""
    for block in python_blocks(page):
        lines = enumerate(block.code.splitlines(), block.line)
        long = [number for number, line in lines if len(line) > 100]
        assert not long, f"{page.name}: lines {long} are longer than 100 characters"

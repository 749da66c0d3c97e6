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

Printed output: a ```` ```text ```` fence that *immediately* follows a run ```` ```python ````
block (only blank lines between them) is that block's expected standard output, and the test
compares it. Trailing whitespace of every line, and blank lines at the end, are ignored;
everything else must match exactly. For a ```` ```python torchrun ```` block the expected text
is what all ranks print to stdout, compared as a multiset of lines: the order of lines across
ranks is not compared, and each rank's stdout is captured in a file of its own, since on the
launcher's one pipe two ranks' lines can interleave mid-line. Text fence tags:

- ```` ```text ````: exact, as above. Examples are seeded so that their output is the same on
  every machine; this is the default and the norm.
- ```` ```text approx ````: the words must match exactly, but each number only to within
  ``APPROX_RTOL`` relative (plus one unit of its last printed digit). Only for a number that
  legitimately depends on the machine (a timing, a thread-count-dependent rounding); say so
  in the prose next to it.
- ```` ```text no-check ````: shown, not compared. Only for output that cannot be reproduced
  here (a GPU, a launcher this machine lacks), after a ```` ```python no-run ```` block.

A ```` ```text ```` fence after a block that runs must be checked: a no-run block followed by
plain ```` ```text ```` fails, so an example's shown output is never silently unchecked.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
import io
import itertools
import math
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from fullbatch._base._versions import FSDP2_CPU_TORCH, PIPELINE_TORCH, torch_version

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
DOC_PAGES = sorted(DOCS.glob("*.md"))
PAGES = [*DOC_PAGES, ROOT / "README.md"]
TAGS = {"no-run", "torchrun"}
TEXT_TAGS = {"approx", "no-check"}
APPROX_RTOL = 1e-2
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
TORCHRUN_TIMEOUT = 120


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the first code line
    info: str
    code: str
    end: int = 0  # 1-based line of the closing fence

    @property
    def language(self) -> str:
        return self.info.split()[0] if self.info.split() else ""

    @property
    def tags(self) -> list[str]:
        return self.info.split()[1:]

    @property
    def id(self) -> str:
        page = self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page
        return f"{page}:{self.line}"

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
        blocks.append(Block(page, i + 2, opening["info"].strip(), code, end=j + 1))
        i = j + 1
    return blocks


def python_blocks(page: Path) -> list[Block]:
    return [b for b in fences(page) if b.language == "python"]


ALL_PYTHON = [b for page in PAGES if page.exists() for b in python_blocks(page)]


def expected_outputs(page: Path) -> dict[str, Block]:
    """``{python block id: the text fence right after it}``: the output the page shows."""
    blocks = fences(page)
    lines = page.read_text(encoding="utf-8").splitlines()
    out = {}
    for before, after in itertools.pairwise(blocks):
        between = lines[before.end : after.line - 2]  # lines after the closing fence
        if (
            before.language == "python"
            and after.language == "text"
            and not any(line.strip() for line in between)
        ):
            out[before.id] = after
    return out


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def _close(expected: str, actual: str) -> bool:
    """``actual`` matches ``expected`` word for word, numbers within ``APPROX_RTOL``."""
    want, got = NUMBER.split(expected), NUMBER.split(actual)
    if want != got:  # the words between the numbers
        return False
    for a, b in zip(NUMBER.findall(expected), NUMBER.findall(actual), strict=True):
        mantissa = a.lower().split("e")[0]
        decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
        exponent = int(a.lower().split("e")[1]) if "e" in a.lower() else 0
        unit = 10.0 ** (exponent - decimals)
        if not math.isclose(float(a), float(b), rel_tol=APPROX_RTOL, abs_tol=unit):
            return False
    return True


def check_output(block: Block, printed: str) -> None:
    """Compare what ``block`` printed with the text fence that follows it, if any."""
    shown = expected_outputs(block.page).get(block.id)
    if shown is None:
        return
    want, got = _lines(shown.code), _lines(printed)
    if block.mode == "torchrun":  # ranks interleave: compare the lines, not their order
        want, got = sorted(want), sorted(got)
    if "approx" in shown.tags:
        same = len(want) == len(got) and all(_close(a, b) for a, b in zip(want, got, strict=True))
    else:
        same = want == got
    if not same:
        diff = "\n".join(
            difflib.unified_diff(want, got, "shown in the page", "printed", lineterm="")
        )
        pytest.fail(
            f"{block.id}: the output shown at line {shown.line} ({shown.info}) is not what "
            f"the block prints:\n{diff}",
            pytrace=False,
        )


# -- in-process blocks: one namespace per page, blocks in order ------------------------------


@dataclass
class PageState:
    namespace: dict[str, Any]
    done: int = 0  # blocks of the page already run
    failed: str | None = None  # id of the block that failed
    printed: dict[str, str] = field(default_factory=dict)  # block id -> its stdout


_STATES: dict[Path, PageState] = {}


def _run_in_page(block: Block) -> str:
    """Run ``block`` (after the page's earlier blocks) and return what it printed."""
    runnable = [b for b in python_blocks(block.page) if b.mode == "run"]
    state = _STATES.setdefault(block.page, PageState({"__name__": "__docs__"}))
    index = runnable.index(block)
    if importlib.util.find_spec("transformers") is None and any(
        "from transformers import" in b.code for b in runnable[: index + 1]
    ):
        pytest.skip("needs transformers (pip install -e '.[hf]')")
    if importlib.util.find_spec("trl") is None and any(
        "from trl import" in b.code or "fullbatch.trl" in b.code for b in runnable[: index + 1]
    ):
        pytest.skip("needs TRL (pip install -e '.[trl]')")
    if (
        state.failed is not None
        and runnable.index(next(b for b in runnable if b.id == state.failed)) < index
    ):
        pytest.fail(f"an earlier block of this page failed: {state.failed}", pytrace=False)
    while state.done <= index:
        current = runnable[state.done]
        state.done += 1
        stdout = io.StringIO()
        try:
            with contextlib.redirect_stdout(stdout):
                exec(current.compiled(), state.namespace)
        except BaseException:
            state.failed = current.id
            if current.id != block.id:
                pytest.fail(f"an earlier block of this page failed: {current.id}", pytrace=False)
            raise
        finally:
            state.printed[current.id] = stdout.getvalue()
    return state.printed[block.id]


def _run_torchrun(block: Block, tmp_path: Path) -> str:
    """Run ``block`` under the launcher and return what its ranks printed to stdout.

    Each rank's stdout goes to its own file (``--redirects 1``): on one shared pipe, two ranks'
    ``print`` calls can interleave in the middle of a line.
    """
    script = tmp_path / f"{block.page.stem}_{block.line}.py"
    script.write_text(block.code, encoding="utf-8")
    logs = tmp_path / "logs"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(block.nproc),
        "--log-dir",
        str(logs),
        "--redirects",
        "1",
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
    files = sorted(logs.rglob("stdout.log"))  # <run id>/attempt_0/<rank>/stdout.log
    printed = "".join(f.read_text(encoding="utf-8") for f in files)
    if proc.returncode != 0:
        output = (printed + proc.stdout + proc.stderr)[-6000:]
        pytest.fail(f"{block.id}: torchrun exited with {proc.returncode}\n{output}")
    assert len(files) == block.nproc, f"{block.id}: expected {block.nproc} rank logs, got {files}"
    return printed


@pytest.mark.timeout(TORCHRUN_TIMEOUT + 60)
@pytest.mark.parametrize("block", ALL_PYTHON, ids=[b.id for b in ALL_PYTHON])
def test_python_example_runs(block: Block, tmp_path: Path) -> None:
    block.compiled()  # every block, run or not, is valid Python
    if block.mode == "no-run":
        pytest.skip("marked no-run: compiled, not executed")
    if "fully_shard" in block.code and torch_version() < FSDP2_CPU_TORCH:
        pytest.skip(f"FSDP2 on CPU needs torch >= 2.7 (pytorch#145935), found {torch_version()}")
    if "fb.Pipeline(" in block.code and torch_version() < PIPELINE_TORCH:
        pytest.skip(f"fullbatch.Pipeline needs torch >= 2.7 (scale_grads), found {torch_version()}")
    if block.mode == "torchrun":
        printed = _run_torchrun(block, tmp_path)
    else:
        printed = _run_in_page(block)
    check_output(block, printed)


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
        if block.language == "text":
            unknown = [t for t in block.tags if t not in TEXT_TAGS]
            known = sorted(TEXT_TAGS)
            assert not unknown, f"{block.id}: unknown text fence tags {unknown}; known: {known}"
            assert len(block.tags) <= 1, f"{block.id}: a text fence takes one tag at most"
    shown = expected_outputs(page)
    for block in python_blocks(page):
        text = shown.get(block.id)
        if text is None:
            continue
        if block.mode == "no-run":
            assert "no-check" in text.tags, (
                f"{text.id}: output after a no-run block cannot be checked; "
                "write ```text no-check and say in the prose why it cannot run here"
            )
        else:
            assert "no-check" not in text.tags, (
                f"{text.id}: this output follows a block that runs, so it is checked; "
                "drop no-check (or use approx for a machine-dependent number)"
            )


def test_docs_pages_exist() -> None:
    names = {p.name for p in DOC_PAGES}
    pages = ("index", "quickstart", "concepts", "distributed", "migrating", "faq")
    assert {f"{name}.md" for name in pages} <= names
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    for name in pages[1:]:
        assert f"]({name}.md)" in index, f"index.md does not link {name}.md"


def test_index_lists_every_accumulator_option() -> None:
    """docs/index.md's option list names every keyword of ``fb.Accumulator``."""
    import inspect

    import fullbatch as fb

    index = (DOCS / "index.md").read_text(encoding="utf-8")
    options = list(inspect.signature(fb.Accumulator).parameters)[2:]
    assert len(options) >= 21
    missing = [n for n in options if f"`{n}=" not in index]
    assert missing == [], f"docs/index.md does not list {missing}"


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


def test_shown_output_is_compared(tmp_path: Path) -> None:
    """The comparison itself: a wrong number fails, an approx number within tolerance passes."""
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nprint('loss 3.5924')\n```\n\n```text\nloss 3.5924\n```\n\n"
        "```python\nprint('took 0.1024 s')\n```\n```text approx\ntook 0.1020 s\n```\n",
        encoding="utf-8",
    )
    exact, approx = python_blocks(page)
    assert set(expected_outputs(page)) == {exact.id, approx.id}
    check_output(exact, "loss 3.5924  \n\n")  # trailing whitespace and blank lines ignored
    with pytest.raises(pytest.fail.Exception, match="not what the block prints"):
        check_output(exact, "loss 3.5925\n")
    check_output(approx, "took 0.1024 s\n")
    with pytest.raises(pytest.fail.Exception):
        check_output(approx, "took 0.2 s\n")
    with pytest.raises(pytest.fail.Exception):
        check_output(approx, "took 0.1020 ms\n")

"""fullbatch's own files are told apart by the package's location, never by a path substring.

A clone made with ``git clone <repo>`` sits in a folder named ``fullbatch``; its ``.venv``
then puts "fullbatch" in the path of every installed file (transformers' own warnings
included), and a substring test misattributes them. These tests keep that from coming back.
"""

from __future__ import annotations

import re
from pathlib import Path

import fullbatch as fb
from conftest import from_fullbatch

TESTS = Path(__file__).resolve().parents[1]
# "fullbatch" (or ".../fullbatch/...") tested for membership in something that is a path.
SUBSTRING = re.compile(
    r"""["'][^"'\n]*fullbatch[^"'\n]*["']\s+(not\s+)?in\s+[^\n]*(filename|__file__|path|co_)"""
)


def test_package_files_are_ours_by_location() -> None:
    import fullbatch._base._warn as ours

    assert from_fullbatch(ours.__file__)
    assert from_fullbatch(str(Path(fb.__file__).parent / "_engine" / "_step.py"))


def test_a_venv_inside_a_clone_named_fullbatch_is_not_ours(tmp_path: Path) -> None:
    venv_file = tmp_path / "fullbatch" / ".venv" / "lib" / "transformers" / "utils.py"
    venv_file.parent.mkdir(parents=True)
    venv_file.write_text("")
    assert not from_fullbatch(str(venv_file))
    assert not from_fullbatch(__file__)  # the tests are not the package either


def test_no_test_identifies_fullbatch_by_a_path_substring() -> None:
    offenders = [
        f"{path.name}:{number}: {line.strip()}"
        for path in sorted(TESTS.rglob("*.py"))
        if path != Path(__file__).resolve()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if SUBSTRING.search(line)
    ]
    assert not offenders, "use conftest.from_fullbatch(filename):\n" + "\n".join(offenders)


def test_the_pattern_catches_the_old_mistake() -> None:
    old = 'assert not [w for w in caught if "fullbatch" in str(w.filename)]'
    assert SUBSTRING.search(old)
    assert not SUBSTRING.search('for name in ("naive", "fullbatch"):')

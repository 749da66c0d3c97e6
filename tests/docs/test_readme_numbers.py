"""The README's measured numbers are what ``benchmarks/readme_numbers.py --write`` stored.

The command itself takes minutes (it runs the demo and both benchmarks), so the suite does not
run it; it checks that README.md says exactly what ``benchmarks/readme_numbers.json`` holds,
which only ``--write`` produces, so a hand edit of either one shows up here.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "readme_numbers", ROOT / "benchmarks" / "readme_numbers.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_says_what_the_command_measured() -> None:
    script = _script()
    results = json.loads(script.RESULTS.read_text(encoding="utf-8"))
    readme = script.README.read_text(encoding="utf-8")
    assert script.rewrite(readme, script.render(results)) == readme, (
        "README.md's measured sections differ from benchmarks/readme_numbers.json: "
        "run `python benchmarks/readme_numbers.py --write` instead of editing either by hand"
    )


def test_every_section_must_be_marked() -> None:
    script = _script()
    with pytest.raises(ValueError, match="markers"):
        script.rewrite("no markers here\n", {"demo": "x"})

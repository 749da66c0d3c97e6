"""An objective that cannot be inferred is said before anything trains: at the model's first
forward (no backward, no step), in the command line's words (``--objective``), exit 2; through
``fb.probe`` a ``ValueError`` there, the parameters untouched. With ``--keep-training`` the
script still runs to its end (the report says nothing was checked, exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _cli_scripts import probe, write_scripts

import fullbatch as fb
from fullbatch._probe._run import ObjectiveUnknown


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return write_scripts(tmp_path)


def test_the_cli_says_it_at_the_first_forward_in_cli_words(folder: Path) -> None:
    result = probe(folder, "--", "python", "train.py", "right")
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    message = lines[0]
    assert message.startswith("fullbatch probe: error: no --objective given, and the objective "
                              "of Linear cannot be inferred")  # fmt: skip
    assert "pass --objective causal_lm, token, sample or FILE.py:FN" in message
    assert "objective=" not in message  # not the Python API's words
    assert "forward 1" not in result.stdout  # stopped inside the first forward


def test_with_keep_training_the_script_still_runs_to_its_end(folder: Path) -> None:
    result = probe(folder, "--keep-training", "--", "python", "train.py", "right")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "script finished" in result.stdout
    assert "no --objective given" in result.stderr
    assert "NOTHING CHECKED" in result.stdout


def test_fb_probe_raises_at_the_first_forward_before_any_backward() -> None:
    model = torch.nn.Linear(4, 3)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ObjectiveUnknown, match=r"objective of Linear cannot be inferred"):
        with fb.probe():
            model(torch.randn(2, 4)).sum().backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert issubclass(ObjectiveUnknown, ValueError)

"""``--keep-training`` never harms the run: whatever the probe fails on (here an objective
function that raises), the script runs to its end, unchanged, and the report says what could
not be checked (exit 2: the declared objective failed). Without ``--keep-training`` the probe
stops the script at that step, as it stops it after the probed windows."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _cli_scripts import probe, write_scripts

from fullbatch._probe._run import Probe


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return write_scripts(tmp_path)


def test_an_objective_that_raises_lets_the_script_run_to_its_end(folder: Path) -> None:
    result = probe(folder, "--objective", "obj.py:broken", "--keep-training", "--", "python",
                   "train.py", "right")  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    assert "stepped 3" in result.stdout and "script finished" in result.stdout
    assert "problem: not checked from window 1 on: the probe failed" in result.stdout
    assert "RuntimeError: the objective's own bug" in result.stderr


def test_without_keep_training_the_same_failure_stops_the_script(folder: Path) -> None:
    result = probe(folder, "--objective", "obj.py:broken", "--", "python", "train.py", "right")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "stepped 1" not in result.stdout  # the first step is where the check failed
    assert "the objective's own bug" in result.stderr


def test_the_run_is_bitwise_the_unprobed_run_when_the_probe_fails() -> None:
    def broken(model: torch.nn.Module, micro: object) -> tuple[torch.Tensor, int]:
        raise RuntimeError("broken objective")

    def train(probed: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(1)
        data = [(torch.randn(n, 4, generator=g), torch.randint(3, (n,), generator=g))
                for n in (2, 3, 1, 4)] * 3  # fmt: skip
        probe = Probe(None, None, objective=broken, windows=2, ranks=None, keep_going=True)
        with probe if probed else contextlib.nullcontext():
            for i, (x, y) in enumerate(data):
                (F.cross_entropy(model(x), y, reduction="sum") / 10).backward()
                if i % 4 == 3:
                    opt.step()
                    opt.zero_grad()
        if probed:
            assert not probe.report.ok and "the probe failed" in str(probe.report)
        return [p.detach().clone() for p in model.parameters()]

    for plain, probed in zip(train(False), train(True), strict=True):
        assert torch.equal(plain, probed)


@pytest.mark.parametrize("keep_going", [True, False])
def test_a_forward_hook_that_fails_never_stops_a_kept_run(
    keep_going: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe's own forward hook raising (here: where it looks for the micro-batch)."""
    import fullbatch._probe._capture as capture

    def broken(ids: object) -> None:
        raise LookupError("the probe's own bug")

    monkeypatch.setattr(capture, "find_micro", broken)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probe = Probe(None, None, objective="sample", windows=1, ranks=None, keep_going=keep_going)
    steps = 0
    with contextlib.ExitStack() as stack:
        if not keep_going:
            stack.enter_context(pytest.raises(LookupError, match="the probe's own bug"))
        with probe:
            for _ in range(2):
                F.cross_entropy(model(torch.randn(3, 4)), torch.tensor([0, 1, 2])).backward()
                opt.step()
                steps += 1
    assert steps == (2 if keep_going else 0)
    assert "not checked from window 1 on: the probe failed (LookupError" in str(probe.report)
    assert probe._hooks._handles == [] and probe._capture._handles == []  # every hook gone

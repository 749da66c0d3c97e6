"""A contrastive loop as users write it: one encoder called twice per iteration on a pair the
loop unpacks (``for step, (q, k) in enumerate(loader)``, ``for q, k in loader``, ``q, k =
pair``). The pair is one micro-batch of a callable objective; a coupled loss (InfoNCE with
in-batch negatives) is never right: named ``"coupled loss"`` undeclared, ``"coupled loss taken
per micro-batch"`` when declared (``coupled=True``, ``--coupled``), and ``window.run_coupled``
is right when declared. Each script runs at top level (``runpy``, or ``fullbatch probe``) and
each case is checked against the float64 full batch of the same loss, computed here.
"""

from __future__ import annotations

import copy
import json
import runpy
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _cli_scripts import probe as probe_cli

import fullbatch as fb
from fullbatch._probe._plot import check_matplotlib, plot_report

SIZES = (3, 5, 4, 6)  # the loop's iterations: the micro-batches a report must count

OBJECTIVES = '''
import torch
import torch.nn.functional as F


def info_nce(model, micro):
    """InfoNCE with in-batch negatives over micro's rows: each q against every k of micro."""
    q, k = (micro["q"], micro["k"]) if isinstance(micro, dict) else micro
    zq, zk = F.normalize(model(q), dim=-1), F.normalize(model(k), dim=-1)
    return F.cross_entropy(zq @ zk.T / 0.1, torch.arange(len(zq)), reduction="sum"), len(zq)


def aligned(model, micro):
    """A per-pair loss: no negatives, separable over rows."""
    q, k = micro
    return (model(q) - model(k)).pow(2).sum(), len(q)
'''

HEAD = """
import sys
import torch
import torch.nn.functional as F
from losses import aligned, info_nce

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))
SIZES = {sizes}
g = torch.Generator().manual_seed(4)
loader = []
for n in SIZES:
    q = torch.randn(n, 8, generator=g)
    loader.append((q, q + 0.1 * torch.randn(n, 8, generator=g)))
start = [p.detach().clone() for p in model.parameters()]
opt = torch.optim.SGD(model.parameters(), lr=1.0)
rows = sum(SIZES)
loss_fn = info_nce if "aligned" not in sys.argv else aligned
"""

LOOPS = {
    "enumerate": """
for step, (q, k) in enumerate(loader):
    zq, zk = model(q), model(k)
    if loss_fn is info_nce:
        zq, zk = F.normalize(zq, dim=-1), F.normalize(zk, dim=-1)
        loss = F.cross_entropy(zq @ zk.T / 0.1, torch.arange(len(zq)), reduction="sum")
    else:
        loss = (zq - zk).pow(2).sum()
    (loss / rows).backward()
""",
    "for q, k": """
for q, k in loader:
    zq, zk = F.normalize(model(q), dim=-1), F.normalize(model(k), dim=-1)
    loss = F.cross_entropy(zq @ zk.T / 0.1, torch.arange(len(zq)), reduction="sum")
    (loss / rows).backward()
""",
    "q, k = pair": """
for pair in loader:
    q, k = pair
    loss, _ = loss_fn(model, (q, k))
    (loss / rows).backward()
""",
}

TAIL = """
opt.step()
update = [p.detach() - s for p, s in zip(model.parameters(), start)]
"""

GRADCACHE = """
import torch
import torch.nn.functional as F
import fullbatch as fb

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))
g = torch.Generator().manual_seed(4)
q = torch.randn(18, 8, generator=g)
batch = {"q": q, "k": q + 0.1 * torch.randn(18, 8, generator=g)}
start = [p.detach().clone() for p in model.parameters()]
opt = torch.optim.SGD(model.parameters(), lr=1.0)


def encode(micro):
    return model(micro["q"]), model(micro["k"])


def scores(reps, rows):
    zq, zk = (F.normalize(z, dim=-1) for z in reps)
    return fb.cross_entropy_sum(zq[rows] @ zk.T / 0.1, torch.arange(len(zk))[rows])


with fb.Accumulator(model, opt, micro_batch_size=5) as acc:
    for window in acc.windows([batch]):
        window.run_coupled(encode, scores)
update = [p.detach() - s for p, s in zip(model.parameters(), start)]
"""


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "losses.py").write_text(textwrap.dedent(OBJECTIVES))
    for name, loop in LOOPS.items():
        script = HEAD.format(sizes=SIZES) + loop + TAIL
        (tmp_path / f"{name.replace(' ', '').replace(',', '_').replace('=', '')}.py").write_text(
            script
        )
    (tmp_path / "gradcache.py").write_text(GRADCACHE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _script(folder: Path, loop: str) -> Path:
    return folder / f"{loop.replace(' ', '').replace(',', '_').replace('=', '')}.py"


def _losses() -> Any:
    import losses  # the folder's objectives, as the scripts import them

    return losses


def _run(script: Path, argv: list[str], **probe_args: Any) -> tuple[dict[str, Any], Any]:
    """The script run at top level under fb.probe: its globals, and the probe."""
    monkey = pytest.MonkeyPatch()
    monkey.setattr("sys.argv", [str(script), *argv])
    try:
        with fb.probe(windows=1, **probe_args) as probe:
            names = runpy.run_path(str(script), run_name="__main__")
    finally:
        monkey.undo()
    return names, probe


def _truth(names: dict[str, Any], loss: Any, whole: Any) -> float:
    """The update's relative distance from the float64 full batch of ``loss`` over ``whole``
    (SGD, lr 1: the update is minus the gradient)."""
    ref = copy.deepcopy(names["model"]).double()
    for p, s in zip(ref.parameters(), names["start"], strict=True):
        p.data.copy_(s)
    total, n = loss(ref, whole)
    (total / n).backward()
    want = torch.cat([-p.grad.flatten() for p in ref.parameters()])
    got = torch.cat([u.flatten() for u in names["update"]]).double()
    return float((got - want).norm() / want.norm())


def _pairs_whole(names: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    loader = names["loader"]
    return torch.cat([q for q, _ in loader]).double(), torch.cat([k for _, k in loader]).double()


@pytest.mark.parametrize("loop", list(LOOPS))
def test_an_unpacked_pair_is_one_micro_batch_and_a_coupled_loss_is_named(
    folder: Path, loop: str
) -> None:
    losses = _losses()
    names, probe = _run(_script(folder, loop), [], objective=losses.info_nce)
    assert _truth(names, losses.info_nce, _pairs_whole(names)) > 0.3  # far from the full batch
    check = probe.report.windows[0]
    assert check.micro_batches == len(SIZES) and check.counts == tuple(map(float, SIZES))
    assert not probe.report.ok and check.pattern == "coupled loss", str(probe.report)
    assert probe.report.verdict == "nothing checked"
    assert "cannot judge a coupled loss per micro-batch" in check.diagnosis
    assert "coupled=True" in check.diagnosis and "--coupled" in check.diagnosis
    assert "window.run_coupled" in check.diagnosis


def test_declared_coupled_names_the_loss_taken_per_micro_batch(folder: Path) -> None:
    losses = _losses()
    names, probe = _run(_script(folder, "enumerate"), [], objective=losses.info_nce, coupled=True)
    truth = _truth(names, losses.info_nce, _pairs_whole(names))
    check = probe.report.windows[0]
    assert not probe.report.ok and probe.report.verdict == "wrong", str(probe.report)
    assert check.pattern == "coupled loss taken per micro-batch"
    assert check.micro_batches == len(SIZES)
    assert abs(check.error - truth) < 1e-4 * truth  # the probe's error is the float64 truth's
    assert "every micro-batch weighted 1.00, its own loss" in check.diagnosis
    assert "window.run_coupled" in check.diagnosis
    assert f"instead of the window's {sum(SIZES)}" in check.diagnosis


def test_a_separable_loss_with_two_forwards_per_iteration_is_right(folder: Path) -> None:
    losses = _losses()
    for coupled in (False, True):  # declared coupled or not: the full batch's either way
        names, probe = _run(
            _script(folder, "enumerate"), ["aligned"], objective=losses.aligned, coupled=coupled
        )
        assert _truth(names, losses.aligned, _pairs_whole(names)) < 1e-5
        check = probe.report.windows[0]
        assert probe.report.ok and check.pattern == "right", str(probe.report)
        assert check.micro_batches == len(SIZES)


def test_window_run_coupled_is_right_when_declared(folder: Path) -> None:
    losses = _losses()
    names, probe = _run(folder / "gradcache.py", [], objective=losses.info_nce, coupled=True)
    batch = names["batch"]
    whole = {key: value.double() for key, value in batch.items()}
    assert _truth(names, losses.info_nce, whole) < 1e-5
    check = probe.report.windows[0]
    assert probe.report.ok and check.pattern == "right", str(probe.report)
    assert check.micro_batches == 4 and check.count == 18  # micro_batch_size=5 over 18 rows
    assert "declared coupled objective (info_nce) over the whole window" in check.diagnosis
    assert check.error <= check.tolerance and abs(check.factor - 1) < 1e-5
    if check_matplotlib() is None:  # --plot: the factor alone where no weight per micro-batch
        plot_report(probe.report, str(folder / "probe.png"))
        assert (folder / "probe.png").stat().st_size > 0


def test_one_backward_for_the_whole_window_keeps_its_micro_batches_apart() -> None:
    """A loop that sums every micro-batch's loss and calls backward once: one backward, but
    each iteration's input is rebound, so the forwards are not one loop value."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    g = torch.Generator().manual_seed(1)
    loader = [(torch.randn(n, 4, generator=g), torch.randint(3, (n,), generator=g)) for n in SIZES]

    def objective(m: torch.nn.Module, micro: Any) -> tuple[torch.Tensor, int]:
        x, y = micro
        return F.cross_entropy(m(x), y, reduction="sum"), len(y)

    with fb.probe(objective=objective, windows=1) as probe:
        total = torch.zeros(())
        for x, y in loader:
            total = total + F.cross_entropy(model(x), y, reduction="sum")
        (total / sum(SIZES)).backward()
        opt.step()
    check = probe.report.windows[0]
    assert probe.report.ok and check.micro_batches == len(SIZES), str(probe.report)


def test_declared_coupled_refuses_by_name_where_it_cannot_compare(folder: Path) -> None:
    losses = _losses()
    with pytest.raises(ValueError, match=r"coupled=True .* got objective='sample'"):
        fb.probe(objective="sample", coupled=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.1))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with fb.probe(objective=losses.info_nce, coupled=True, windows=1) as probe:
        for n in SIZES:
            q = torch.randn(n, 8)
            k = q + 0.1
            loss, _ = losses.info_nce(model, (q, k))
            loss.backward()
        opt.step()
    check = probe.report.windows[0]
    assert not probe.report.ok and check.pattern == "coupled loss", str(probe.report)
    assert "dropout is active" in check.diagnosis and "window.run_coupled" in check.diagnosis


def test_the_command_line_declares_it_and_the_json_carries_the_verdict(folder: Path) -> None:
    declared = probe_cli(
        folder, "--objective", "losses.py:info_nce", "--coupled", "--json", "probe.json",
        "--", "python", "enumerate.py",
    )  # fmt: skip
    assert declared.returncode == 1, declared.stdout + declared.stderr
    assert "coupled loss taken per micro-batch" in declared.stdout
    data = json.loads((folder / "probe.json").read_text())
    window = data["windows"][0]
    assert (data["verdict"], window["pattern"]) == ("wrong", "coupled loss taken per micro-batch")
    assert window["micro_batches"] == len(SIZES)
    refused = probe_cli(folder, "--objective", "sample", "--coupled", "--", "python", "forq_k.py")
    assert refused.returncode == 2 and "--coupled declares" in refused.stderr

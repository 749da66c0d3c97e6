"""The report as data (``report.to_dict()``, ``fullbatch probe --json``): every field of the
report and of each window under its own name (a field added to the dataclasses flows through),
per optimizer and per rank, JSON without NaN, and checked against the schema the package
documents (``fullbatch._probe._export.SCHEMA``, versioned); the check itself can fail."""

from __future__ import annotations

import copy
import dataclasses
import json
from collections import OrderedDict

import torch
import torch.nn.functional as F

import fullbatch as fb
from fullbatch._probe._export import SCHEMA, SCHEMA_VERSION, problems
from fullbatch._probe._report import WindowCheck


def _two_optimizers_one_doubled() -> fb.probe:
    torch.manual_seed(0)
    model = torch.nn.Sequential(OrderedDict(
        body=torch.nn.Linear(4, 8), act=torch.nn.Tanh(), head=torch.nn.Linear(8, 3)))  # fmt: skip
    opt_body = torch.optim.SGD(model.body.parameters(), lr=0.1)
    opt_head = torch.optim.SGD(model.head.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    loader = [(torch.randn(n, 4, generator=g), torch.randint(3, (n,), generator=g))
              for n in (1, 3, 2, 6)] * 2  # fmt: skip
    with fb.probe(objective="sample") as probe:
        for i, (x, y) in enumerate(loader):
            (F.cross_entropy(model(x), y, reduction="sum") / 12).backward()
            if (i + 1) % 4 == 0:
                for p in model.body.parameters():
                    p.grad *= 2  # the body's gradients doubled: wrong there only
                opt_body.step()
                opt_head.step()
                opt_body.zero_grad()
                opt_head.zero_grad()
    return probe


def test_the_report_as_data_fits_the_schema_and_says_what_the_text_says() -> None:
    report = _two_optimizers_one_doubled().report
    data = json.loads(json.dumps(report.to_dict(), allow_nan=False))
    assert problems(data) == []
    assert data["schema_version"] == SCHEMA_VERSION == 1
    assert (data["ok"], data["verdict"], data["requested"]) == (False, "wrong", 2)
    assert [w["step"] for w in data["windows"]] == [1, 2]
    for window, check in zip(data["windows"], report.windows, strict=True):
        assert set(f.name for f in dataclasses.fields(WindowCheck)) <= set(window)
        assert window["weights"] == list(check.weights) and len(window["weights"]) == 4
        assert window["micro_batch_ranks"] == [0, 0, 0, 0]
        assert window["error"] == check.error > window["tolerance"]
        assert window["pattern"] == check.pattern and window["diagnosis"] == check.diagnosis
        body, head = window["per_optimizer"]
        assert body["label"].startswith("optimizer 1 (SGD: body.weight")
        assert (body["ok"], body["pattern"]) == (False, "not normalized")
        assert abs(body["factor"] - 2) < 1e-5
        assert (head["ok"], head["pattern"]) == (True, "right")


def test_nan_is_null_and_the_schema_check_can_fail() -> None:
    report = _two_optimizers_one_doubled().report
    check = dataclasses.replace(report.windows[0], weights=(float("nan"), 1.0), clip=(1.0, 2.5))
    data = dataclasses.replace(report, windows=(check,)).to_dict()
    window = data["windows"][0]
    assert window["weights"][0] is None and window["clip"] == {"max_norm": 1.0, "total_norm": 2.5}
    assert problems(data) == []
    broken = copy.deepcopy(data)
    del broken["windows"][0]["tolerance"]
    broken["windows"][0]["ok"] = "yes"
    broken["schema_version"] = 1.5
    assert set(problems(broken)) == {
        "$.schema_version: expected integer, got float",
        "$.windows[0]: missing key 'tolerance'",
        "$.windows[0].ok: expected boolean, got str",
    }
    assert problems([], SCHEMA) == ["$: expected object, got list"]


def test_a_field_added_to_the_windows_flows_through() -> None:
    """The export is generic over the dataclass fields (another engineer adds some)."""
    extended = dataclasses.make_dataclass(
        "Extended", [("source", str, dataclasses.field(default="declared"))], bases=(WindowCheck,),
        frozen=True,
    )  # fmt: skip
    report = _two_optimizers_one_doubled().report
    check = extended(**{f.name: getattr(report.windows[0], f.name)
                        for f in dataclasses.fields(WindowCheck)})  # fmt: skip
    data = dataclasses.replace(report, windows=(check,)).to_dict()
    assert data["windows"][0]["source"] == "declared" and problems(data) == []

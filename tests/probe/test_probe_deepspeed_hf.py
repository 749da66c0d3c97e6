"""``fb.probe`` on the Hugging Face Trainer with a DeepSpeed config and on Accelerate's
DeepSpeed plugin, 2 gloo ranks on CPU, one process group (tests/_probe_ds_hf_cases.py).

The stock Trainer at ZeRO-2 with offload on a causal LM that honours ``num_items_in_batch`` is
right (and its parameters are bitwise those of an unprobed run); on a BERT masked-LM head that
drops it (ZeRO-3) the probe says wrong, several times off (the issue measured 3.2 on 1 rank);
with ``gradient_clipping`` left out of the DeepSpeed config, DeepSpeed clips at its default 1.0
although ``max_grad_norm`` is 0.3: the accumulation is right (compared before the clip) but the
step is not the one asked for, and the probe says so, naming both values and where each comes
from (the update's norm, read from the parameters, is the learning rate times 1.0, not 0.3).
``ExactTrainer`` (ZeRO-3, offload) is right. A loop on Accelerate's
DeepSpeed engine that backpropagates per-micro-batch means is "mean of per-micro-batch means"
and the fix names ``ExactEngine``; ``ExactEngine`` on the same prepared engine is right.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

import _probe_ds_hf_cases as cases
from _dist_ds import run_ds, values

pytestmark = pytest.mark.timeout(400)

WORLD = 2
STOCK, MASKED, NO_CLIP, EXACT = cases.TRAINER_RUNS


@pytest.fixture(scope="module")
def results() -> list[dict[Any, Any]]:
    return values(run_ds(cases.everything, WORLD, 16 * WORLD, deadline=360))


def _reports(results: list[dict[Any, Any]], key: Any) -> list[Any]:
    reports = [r[key]["report"] if isinstance(r[key], dict) else r[key] for r in results]
    said = [[(w.ok, w.pattern, w.error, w.clip) for w in r.windows] for r in reports]
    assert all(s == said[0] for s in said), key  # every rank says the same
    for report in reports:
        assert len(report.windows) == 2 and report.problems == ()
        assert all(w.micro_batches == cases.K * WORLD for w in report.windows)
        assert all(w.ranks == (cases.K,) * WORLD for w in report.windows)
    return reports


def test_stock_trainer_causal_lm_is_right_and_unchanged(results: list[Any]) -> None:
    for report in _reports(results, STOCK):
        assert report.ok, str(report)
        assert [w.engine for w in report.windows] == ["transformers.Trainer"] * 2
        assert all(w.error < 1e-6 and w.clip is None for w in report.windows)
    for res in results:  # the probed run's parameters are the unprobed run's, bitwise
        plain, probed = res["plain"]["steps"], res[STOCK]["steps"]
        assert len(plain) == len(probed) == 2
        for a, b in zip(plain, probed, strict=True):
            assert all(torch.equal(a[name], b[name]) for name in a)


def test_stock_trainer_masked_lm_head_is_wrong(results: list[Any]) -> None:
    for report in _reports(results, MASKED):
        assert not report.ok
        assert all(w.error > 1.0 for w in report.windows), str(report)
        assert "fullbatch.hf.ExactTrainer" in report.windows[0].diagnosis


def test_deepspeed_default_clip_against_max_grad_norm_is_named(results: list[Any]) -> None:
    import _hf_cases as h

    for report in _reports(results, NO_CLIP):
        assert not report.ok, str(report)
        for window in report.windows:
            assert window.pattern == "clip differs", window.diagnosis
            assert window.error < 1e-5  # the accumulation itself is right
            assert window.clip is not None and window.clip[0] == 1.0
            assert window.clip[1] > 1.0  # DeepSpeed did clip: the norm was above 1.0
            text = window.diagnosis
            assert "TrainingArguments.max_grad_norm=0.3" in text, text
            assert "default gradient_clipping=1 (the config leaves gradient_clipping out)" in text
            assert "TrainingArguments.max_grad_norm=0.3" in window.clip_asked
    # the truth, from the parameters: SGD(lr=0.1) moved them by lr x 1.0 (DeepSpeed's clip),
    # where max_grad_norm=0.3 asks lr x 0.3: the probe's ratio is the run's
    start = {n: p.detach().double() for n, p in h.llama().float().named_parameters()}
    for res, report in zip(results, _reports(results, NO_CLIP), strict=True):
        first = res[NO_CLIP]["steps"][0]
        moved = sum(float((first[n] - start[n]).pow(2).sum()) for n in start) ** 0.5
        assert moved == pytest.approx(0.1 * 1.0, rel=1e-4)
        said = float(report.windows[0].diagnosis.split(" x the update asked for")[0].split()[-1])
        assert said == pytest.approx(moved / (0.1 * 0.3), rel=1e-2)


def test_exact_trainer_on_deepspeed_is_right(results: list[Any]) -> None:
    for report in _reports(results, EXACT):
        assert report.ok, str(report)
        assert report.windows[0].engine == "fullbatch.hf.ExactTrainer"


def test_accelerate_deepspeed_plugin(results: list[Any]) -> None:
    for report in _reports(results, ("accelerate", "mean")):
        first = report.windows[0]
        assert first.pattern == "mean of per-micro-batch means", first.diagnosis
        assert "fullbatch.deepspeed.ExactEngine" in first.diagnosis
    for report in _reports(results, ("accelerate", "exact")):
        assert report.ok, str(report)
        assert report.windows[0].engine == "fullbatch.deepspeed.ExactEngine"

"""The objective the probe judges under: the trainer's own where fullbatch knows it, a refusal
before anything trains where it does not (never a verdict under a guessed objective), the unit
of ``"sample"`` against the loss's own reduction, and the renamed objective names. Each verdict
is checked against a plain float64 full batch written here."""

from __future__ import annotations

import copy
import tempfile
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fullbatch as fb


def regression_run(per_micro_mean: bool) -> tuple[float, Any]:
    """A 3-output regression, F.mse_loss (a mean over elements), micro-batches of 2, 5, 3, 6
    rows; ``per_micro_mean``: each micro-batch's own mean over K (a mean of means), else the
    window's element mean (right). Returns the update's error against the float64 full
    batch's ``F.mse_loss`` step, and the probe (``objective="sample"``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))
    g = torch.Generator().manual_seed(3)
    micros = [
        (torch.randn(n, 4, generator=g), torch.randn(n, 3, generator=g)) for n in (2, 5, 3, 6)
    ]
    ref = copy.deepcopy(model).double()
    F.mse_loss(ref(torch.cat([x for x, _ in micros]).double()),
               torch.cat([y for _, y in micros]).double()).backward()  # fmt: skip
    truth = torch.cat([p.grad.flatten() for p in ref.parameters()])
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    elements = sum(y.numel() for _, y in micros)
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()]).double()
    with fb.probe(objective="sample", windows=1) as probe:
        for x, y in micros:
            if per_micro_mean:
                loss = F.mse_loss(model(x), y) / len(micros)
            else:
                loss = F.mse_loss(model(x), y, reduction="sum") / elements
            loss.backward()
        opt.step()
    after = torch.cat([p.detach().flatten() for p in model.parameters()]).double()
    return float((before - after - truth).norm() / truth.norm()), probe


def test_sample_regression_in_mse_loss_elements_is_right() -> None:
    error, probe = regression_run(per_micro_mean=False)
    assert error < 1e-6  # the truth: right
    check = probe.report.windows[0]
    assert probe.report.ok, str(probe.report)
    assert "counted in elements: a mean over each row's 3 outputs" in check.diagnosis
    assert check.factor == pytest.approx(1 / 3, rel=1e-5)


def test_sample_regression_mean_of_means_is_still_wrong() -> None:
    error, probe = regression_run(per_micro_mean=True)
    assert error > 0.05  # the truth: wrong
    check = probe.report.windows[0]
    assert not probe.report.ok
    assert check.pattern == "mean of per-micro-batch means", check.diagnosis


def test_renamed_objective_warns_and_runs_under_its_new_name() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 8), nn.Linear(8, 11))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    micros = [torch.randint(11, (2, n), generator=g) for n in (3, 5)]
    with pytest.warns(DeprecationWarning, match="objective='masked_lm' is deprecated: it is "
                      "now objective='token'"):  # fmt: skip
        probe = fb.probe(objective="masked_lm", windows=1)
    with probe:
        for ids in micros:
            labels = ids.flip(-1)
            F.cross_entropy(model(ids).flatten(0, 1), labels.flatten(), reduction="sum").div(
                16
            ).backward()
        opt.step()
    check = probe.report.windows[0]
    assert probe.report.ok and check.objective == "token", str(probe.report)
    assert check.objective_source == "declared"


# -- trainers ----------------------------------------------------------------------------------


class Tagger(nn.Module):
    """A token tagger that is no Hugging Face head: its objective cannot be read off its class."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(100, 16, dtype=torch.float64)
        self.out = nn.Linear(16, 100, dtype=torch.float64)

    def forward(self, input_ids: torch.Tensor, attention_mask: Any = None, **_: Any) -> Any:
        return {"logits": self.out(torch.tanh(self.emb(input_ids)))}


def _tagged_rows(n: int) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(5)
    rows = []
    for i in range(n):
        ids = torch.randint(1, 100, (3 + (i * 5) % 7,), generator=g)
        labels = ids.roll(1).masked_fill(ids % 4 == 0, -100)
        rows.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return rows


def _collate(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.tensor([r["input_ids"] + [0] * (width - len(r["input_ids"])) for r in rows])
    labels = torch.tensor([r["labels"] + [-100] * (width - len(r["labels"])) for r in rows])
    return {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": labels}


def test_exact_trainer_objective_is_its_loss_and_the_old_name_warns() -> None:
    """``ExactTrainer(loss="masked_lm")`` (last release's name: a DeprecationWarning) on a model
    whose objective no head says: the probe judges under the trainer's ``"token"``."""
    pytest.importorskip("transformers")
    from transformers import TrainerCallback

    from _hf_cases import training_args
    from fullbatch.hf import ExactTrainer

    k, batch, rows = 4, 2, _tagged_rows(8)
    first: dict[str, Any] = {}

    class Applied(TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            first.setdefault("grads", [p.grad.clone() for p in kw["model"].parameters()])

    model = Tagger()
    start = copy.deepcopy(model)
    with tempfile.TemporaryDirectory() as tmp:
        args = training_args(tmp, k=k, batch=batch, train_sampling_strategy="sequential")
        with pytest.warns(DeprecationWarning, match="loss='masked_lm' is deprecated"):
            trainer = ExactTrainer(model=model, args=args, train_dataset=rows,
                                   data_collator=_collate, callbacks=[Applied()],
                                   loss="masked_lm")  # fmt: skip
        assert trainer.fb_loss == "token"
        with fb.probe(windows=1) as probe:
            trainer.train()
    full = _collate(rows[: k * batch])  # the truth: the window's rows as one float64 batch
    logits = start(full["input_ids"])["logits"]
    F.cross_entropy(logits.flatten(0, 1), full["labels"].flatten()).backward()
    truth = [p.grad for p in start.parameters()]
    diff = sum(float((a - b).pow(2).sum()) for a, b in zip(first["grads"], truth, strict=True))
    assert (diff / sum(float(b.pow(2).sum()) for b in truth)) ** 0.5 < 1e-10
    check = probe.report.windows[0]
    assert probe.report.ok, str(probe.report)
    assert check.objective == "token"
    assert check.objective_source == "fullbatch.hf.ExactTrainer(loss='token')"

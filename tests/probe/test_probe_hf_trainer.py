"""``fb.probe`` around ``trainer.train()``: the stock Hugging Face Trainer on a head that drops
``num_items_in_batch`` is flagged, ``fullbatch.hf.ExactTrainer`` (labels withheld from the
model) passes, and the stock Trainer on a causal LM is judged by what the installed
transformers counts, each against a plain full-batch gradient computed here from the first
window's rows."""

from __future__ import annotations

import copy
import tempfile
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import fullbatch as fb

pytest.importorskip("transformers")
from _hf_cases import Collator, bert, in_order, llama, text_rows, training_args

K, BATCH = 4, 2


def _rows() -> list[dict[str, Any]]:
    """Rows of 6 to 22 tokens: micro-batches hold different numbers of targets."""
    rows = text_rows(2 * K * BATCH)
    return [{**r, "input_ids": r["input_ids"][: 6 + (i * 5) % 17]} for i, r in enumerate(rows)]


def _train(make_model: Any, kind: str, *, exact: str | None, **overrides: Any) -> dict[str, Any]:
    """One epoch under the probe (first window); the gradient at the first step, the rows."""
    from transformers import Trainer, TrainerCallback

    first: dict[str, Any] = {}

    class Applied(TrainerCallback):  # after clipping, right before optimizer.step()
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if "grads" not in first:
                first["grads"] = {n: p.grad.clone() for n, p in kw["model"].named_parameters()}

    model = make_model()
    start = copy.deepcopy(model)
    collator = Collator(kind)
    with tempfile.TemporaryDirectory() as tmp:
        args = training_args(tmp, k=K, batch=BATCH, **overrides)
        kwargs: dict[str, Any] = dict(
            model=model, args=args, train_dataset=_rows(),
            data_collator=collator, callbacks=[Applied()],
        )  # fmt: skip
        if exact is None:
            trainer: Any = Trainer(**kwargs)
        else:
            from fullbatch.hf import ExactTrainer

            trainer = ExactTrainer(**kwargs, loss=exact)
        with fb.probe() as probe:  # objective inferred from the head
            in_order(trainer).train()
    rows = [i for batch in collator.seen[:K] for i in batch]
    return {"report": probe.report, "grads": first["grads"], "start": start, "rows": rows}


def _reference(kind: str, start: torch.nn.Module, rows: list[int]) -> dict[str, Any]:
    """Plain PyTorch: the first window's rows as one batch, a mean loss, one backward."""
    model = start
    batch = Collator(kind)([_rows()[i] for i in rows])
    labels = batch.pop("labels")
    logits = model(**batch).logits
    if kind == "causal_lm":
        logits, labels = logits[:, :-1], labels[:, 1:]
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _rel(a: dict, b: dict) -> float:
    diff = sum(float((a[n].double() - b[n].double()).pow(2).sum()) for n in b)
    return (diff / sum(float(b[n].double().pow(2).sum()) for n in b)) ** 0.5


def _window_labels(kind: str, rows: list[int]) -> list[torch.Tensor]:
    """The first window's micro-batches' labels, as the Trainer collated them."""
    data = _rows()
    return [Collator(kind)([data[i] for i in rows[k : k + BATCH]])["labels"]
            for k in range(0, K * BATCH, BATCH)]  # fmt: skip


def _stock_count(labels: list[torch.Tensor]) -> float:
    """``num_items_in_batch`` as the installed Trainer counts the window (its own code)."""
    from transformers import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(model=llama(), args=training_args(tmp, k=K, batch=BATCH))
        batches = [{"labels": label} for label in labels]
        _, items = trainer.get_batch_samples(iter(batches), K, torch.device("cpu"))
    return float(items)


def test_stock_trainer_on_a_head_that_drops_num_items_is_flagged() -> None:
    """BERT's masked-LM head drops ``num_items_in_batch``: each micro-batch's own mean, which
    transformers 5 leaves undivided (x K) and 4.x divides by K (a mean of means either way)."""
    run = _train(lambda: bert("masked_lm"), "masked_lm", exact=None)
    (check,) = run["report"].windows
    ref = _reference("masked_lm", run["start"], run["rows"])
    assert not run["report"].ok
    assert check.engine == "transformers.Trainer" and check.objective == "token"
    assert check.pattern == "mean of per-micro-batch means"
    assert "fullbatch.hf.ExactTrainer" in check.diagnosis
    assert check.error == pytest.approx(_rel(run["grads"], ref), rel=1e-6)
    n = [float((label != -100).sum()) for label in _window_labels("masked_lm", run["rows"])]
    means = [sum(n) / k for k in n]  # weight of a micro-batch's mean, relative to 1/N
    undivided = check.weights == pytest.approx(means, rel=1e-6)
    assert undivided or check.weights == pytest.approx([w / K for w in means], rel=1e-6)
    assert ("x4 (= K" in check.diagnosis) is undivided and check.error > 0.1


def test_exact_trainer_passes_with_labels_withheld_from_the_model() -> None:
    run = _train(lambda: bert("classification"), "classification", exact="sample")
    ref = _reference("classification", run["start"], run["rows"])
    assert run["report"].ok, str(run["report"])
    (check,) = run["report"].windows
    assert check.engine == "fullbatch.hf.ExactTrainer" and check.micro_batches == K
    assert check.objective == "sample"  # inferred from BertForSequenceClassification
    assert _rel(run["grads"], ref) < 1e-10 and check.error < 1e-10
    assert check.weights == pytest.approx([1.0] * K, rel=1e-6)


def test_stock_trainer_on_a_causal_lm_is_judged_by_its_own_count() -> None:
    """Llama consumes num_items_in_batch. transformers 5 counts the window's targets after the
    causal shift: the stock step is exact up to float32 rounding (its causal-LM loss upcasts the
    logits to float32 only, so on this float64 model it rounds them), which the probe's band
    covers. transformers 4.53 counted every label before the shift (one per row too many): the
    probe flags that as "not normalized", every micro-batch weighted N / N_unshifted."""
    run = _train(llama, "causal_lm", exact=None)
    ref = _reference("causal_lm", run["start"], run["rows"])
    (check,) = run["report"].windows
    labels = _window_labels("causal_lm", run["rows"])
    shifted = float(sum(fb.count_tokens(label) for label in labels))
    assert check.objective == "causal_lm" and check.count == shifted
    counted = _stock_count(labels)
    if counted == shifted:
        assert run["report"].ok, str(run["report"])
        assert 1e-15 < check.tolerance < 1e-6 and _rel(run["grads"], ref) < 1e-6
        return
    assert counted == float(sum((label != -100).sum() for label in labels)) > shifted
    assert not run["report"].ok and check.pattern == "not normalized"
    assert check.weights == pytest.approx([shifted / counted] * K, rel=1e-6)
    assert check.error == pytest.approx(_rel(run["grads"], ref), rel=1e-6)
    assert check.error == pytest.approx(1 - shifted / counted, rel=1e-5)


def test_exact_trainer_with_clipping_is_compared_before_the_clip() -> None:
    run = _train(lambda: bert("masked_lm"), "masked_lm", exact="token", max_grad_norm=1e-3)
    (check,) = run["report"].windows
    assert run["report"].ok, str(run["report"])
    assert check.clip is not None and check.clip[0] == 1e-3 and check.clip[1] > 1e-3
    assert check.objective == "token"
    ref = _reference("masked_lm", run["start"], run["rows"])
    norm = sum(float(g.pow(2).sum()) for g in ref.values()) ** 0.5
    assert check.clip[1] == pytest.approx(norm, rel=1e-9)  # the clip saw the full batch's norm
    clipped = {n: g * (1e-3 / (norm + 1e-6)) for n, g in ref.items()}
    assert _rel(run["grads"], clipped) < 1e-9

"""The probe's diagnosis of an MoE model trained with a per-micro-batch load-balancing loss:
"a window statistic taken per micro-batch", with the share of the error it explains; an exact
window (the window's routing counts) has nothing to name, and a cross-entropy mistake with an
exact aux term is not blamed on the statistic."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

import fullbatch as fb
from _moe_cases import COEF, TOP_K, VOCAB, aux64, forward, make_moe, moe_rows, reference, split
from fullbatch._probe._window_stat import NAMED, window_statistic_per_micro_batch

LENGTHS = (7, 3, 5, 7, 2, 6, 4, 7)
SIZES = (2, 3, 1, 2)


def _ce(out: Any, micro: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    labels = micro["labels"][:, 1:]
    logits = out.logits[:, :-1].reshape(-1, VOCAB)
    ce = F.cross_entropy(logits, labels.reshape(-1), ignore_index=-100, reduction="sum")
    return ce, int((labels != -100).sum())


def _accumulated(model: Any, micros: list[Any], share: Callable[..., Any]) -> list[torch.Tensor]:
    """The gradient a loop applies that backpropagates ``share(out, micro, ...)`` per micro."""
    model.zero_grad(set_to_none=True)
    total = sum(_ce(forward(model, m), m)[1] for m in micros)
    with torch.no_grad():  # the window's router logits: constants (their routing counts)
        routed = [forward(model, m).router_logits for m in micros]
    window_logits = [torch.cat(layer) for layer in zip(*routed, strict=True)]
    window_mask = torch.cat([m["attention_mask"] for m in micros])
    for m in micros:
        out = forward(model, m)
        share(out, m, total, len(micros), window_logits, window_mask).backward()
    grads = [
        p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()
    ]
    model.zero_grad(set_to_none=True)
    return grads


def _own_aux(out: Any, m: Any, total: int, k: int, *_: Any) -> torch.Tensor:
    """transformers' forward per micro-batch with the Trainer's num_items_in_batch."""
    return _ce(out, m)[0] / total + COEF * aux64(out.router_logits, m["attention_mask"])


def _loss_over_ga(out: Any, m: Any, total: int, k: int, *_: Any) -> torch.Tensor:
    """``model(**micro).loss / GA``: each micro-batch's mean, its own aux, over K."""
    ce, n = _ce(out, m)
    return (ce / n + COEF * aux64(out.router_logits, m["attention_mask"])) / k


def _mean_ce_window_aux(
    out: Any, m: Any, total: int, k: int, logits: Any, mask: Any
) -> torch.Tensor:
    """A cross-entropy mistake (mean of means) with the aux term exact over the window."""
    ce, n = _ce(out, m)
    counts = fb.moe.router_counts(logits, top_k=TOP_K, attention_mask=mask)
    aux = fb.moe.load_balancing(out.router_logits, counts, attention_mask=m["attention_mask"])
    return ce / (n * k) + COEF * aux


@pytest.fixture(scope="module")
def case() -> tuple[Any, list[Any], list[torch.Tensor]]:
    model = make_moe("mixtral")
    model.config.output_router_logits = True
    rows = moe_rows(LENGTHS, seed=3)
    want, _ = reference(model, rows)
    return model, split(rows, SIZES), want


def test_per_micro_batch_aux_is_named(case: Any) -> None:
    """The cross-entropy exact (the Trainer's num_items_in_batch): the statistic is the whole
    error, and the sentence names it with its share."""
    model, micros, want = case
    applied = _accumulated(model, micros, _own_aux)
    got = window_statistic_per_micro_batch(model, micros, applied, want)
    assert got is not None and got.named and got.share > 0.999, got
    assert got.sentence().startswith(NAMED)
    assert f"{got.share:.0%}" in got.sentence()


def test_loss_over_ga_share_is_measured_not_named(case: Any) -> None:
    """``loss / GA``: the mean of per-micro-batch means dominates (the probe's weight patterns
    name it); the per-micro-batch statistic is measured as a small share and not named."""
    model, micros, want = case
    applied = _accumulated(model, micros, _loss_over_ga)
    got = window_statistic_per_micro_batch(model, micros, applied, want)
    assert got is not None and 0.0 < got.share < 0.05 and not got.named, got


def test_exact_window_names_nothing(case: Any) -> None:
    model, micros, want = case

    def exact(out: Any, m: Any, total: int, k: int, logits: Any, mask: Any) -> torch.Tensor:
        counts = fb.moe.router_counts(logits, top_k=TOP_K, attention_mask=mask)
        aux = fb.moe.load_balancing(out.router_logits, counts, attention_mask=m["attention_mask"])
        return _ce(out, m)[0] / total + COEF * aux

    applied = _accumulated(model, micros, exact)
    assert window_statistic_per_micro_batch(model, micros, applied, want) is None


def test_cross_entropy_mistake_is_not_blamed_on_the_statistic(case: Any) -> None:
    model, micros, want = case
    applied = _accumulated(model, micros, _mean_ce_window_aux)
    got = window_statistic_per_micro_batch(model, micros, applied, want)
    assert got is not None and not got.named, got


def test_dense_model_is_not_judged(case: Any) -> None:
    model, micros, want = case
    model.config.output_router_logits = False
    try:
        assert window_statistic_per_micro_batch(model, micros, want, want) is None
    finally:
        model.config.output_router_logits = True

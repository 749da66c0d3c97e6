"""``fullbatch.composer.TokenCounts``: the recipe that makes Composer's token accumulation exact.

Composer pins an old torch, so CI cannot install it. ``composer_step`` below replays, in a few
lines, what Composer 0.32.1's ``Trainer._train_batch`` does with
``accumulate_train_batch_on_tokens=True`` (``composer/trainer/trainer.py``): it asks the
DataSpec for every micro-batch's ``"loss_generating"`` tokens, sums them over micro-batches and
ranks, asks again for each micro-batch just before its forward, and backpropagates
``loss["total"] * n / (N / W)``; DDP then averages over the ``W`` ranks. Against a float64 full
batch written in plain PyTorch the recipe is exact; a DataSpec count without the causal shift
is not, and ``TokenCounts`` refuses it on the first micro-batch.
``benchmarks/seed_frameworks.py`` runs the real Composer where it installs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from fullbatch.composer import TokenCounts

VOCAB = 11


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(VOCAB, 8), nn.Tanh(), nn.Linear(8, VOCAB)).double()


def _rows(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (int(torch.randint(1, 8, (1,), generator=g)),), generator=g)
            for _ in range(n)]  # fmt: skip


def _pad(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
        labels[i, : len(r)] = r
    return {"input_ids": ids, "labels": labels}


def composer_step(
    model: nn.Module,
    per_rank: list[list[dict[str, torch.Tensor]]],
    count: Callable[[Any], Any],
    loss: Callable[[torch.Tensor, Any], dict[str, torch.Tensor]],
) -> list[torch.Tensor]:
    """One Composer training batch on ``len(per_rank)`` simulated DDP ranks (micro-batches
    per rank); returns the gradient DDP would leave on every rank (the ranks' average)."""
    world = len(per_rank)

    def tokens(batch: Any) -> float:
        out = count(batch)
        return float(out["loss_generating"] if isinstance(out, dict) else out)

    current = sum(tokens(b) for micro in per_rank for b in micro) / world  # all-reduce / W
    grads = [torch.zeros_like(p) for p in model.parameters()]
    for micro in per_rank:  # each rank
        model.zero_grad(set_to_none=True)
        for batch in micro:
            n = tokens(batch)  # asked again just before the forward
            out = loss(model(batch["input_ids"]), batch)["total"]
            (out * (n / current)).backward()
        for g, p in zip(grads, model.parameters(), strict=True):
            g += p.grad / world  # DDP's average
    return grads


def _full_batch_grad(per_rank: list[list[dict[str, torch.Tensor]]]) -> list[torch.Tensor]:
    model = _model()
    logits, labels = [], []
    for micro in per_rank:
        for b in micro:
            logits.append(model(b["input_ids"])[:, :-1].reshape(-1, VOCAB))
            labels.append(b["labels"][:, 1:].reshape(-1))
    loss = nn.functional.cross_entropy(torch.cat(logits), torch.cat(labels), reduction="mean")
    return list(torch.autograd.grad(loss, list(model.parameters())))


def _data(world: int) -> list[list[dict[str, torch.Tensor]]]:
    sizes = [[3, 1, 4], [2, 5, 1]][:world]
    return [[_pad(_rows(k, seed=10 * r + i)) for i, k in enumerate(s)] for r, s in enumerate(sizes)]


def _error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    num = sum(float((a - b).square().sum()) for a, b in zip(got, want, strict=True))
    return (num / sum(float(b.square().sum()) for b in want)) ** 0.5


@pytest.mark.parametrize("world", [1, 2])
def test_the_recipe_is_the_full_batch(world: int) -> None:
    data = _data(world)
    counts = TokenCounts(shift=True)
    got = composer_step(_model(), data, counts, counts.loss)
    assert _error(got, _full_batch_grad(data)) < 1e-13
    assert counts.checked == sum(len(m) for m in data)


def test_a_count_without_the_shift_is_refused_on_the_first_micro_batch() -> None:
    """The lab's mistake: the DataSpec counts labels, not targets (one more per row). Unchecked
    it trains about 1% off; checked, the first micro-batch raises naming both counts."""
    data = _data(2)

    def unshifted(batch: Any) -> int:
        return int((batch["labels"] != -100).sum())

    unchecked = TokenCounts(shift=True, check=0)
    off = _error(composer_step(_model(), data, unshifted, unchecked.loss), _full_batch_grad(data))
    assert off > 1e-3, off
    checked = TokenCounts(shift=True)
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    first = data[0][0]["labels"]
    targets = int((first[:, 1:] != -100).sum())  # one fewer than the labels in each row
    match = rf"DataSpec counted {targets + len(first)} .* the loss holds {targets} .*shift"
    with pytest.raises(ValueError, match=match):
        composer_step(model, data, checked.watch(unshifted), checked.loss)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert all(p.grad is None for p in model.parameters())  # raised before any backward
    # the nearest correct form: the user's own count function, shifted, stays silent
    right = TokenCounts(shift=True)

    def shifted(batch: Any) -> dict[str, int]:
        return {"total": 0, "loss_generating": int((batch["labels"][:, 1:] != -100).sum())}

    got = composer_step(_model(), data, right.watch(shifted), right.loss)
    assert _error(got, _full_batch_grad(data)) < 1e-13


def test_a_loss_without_the_data_spec_asking_first_raises() -> None:
    """Token accumulation off (Composer weights by samples) or a DataSpec not wired."""
    counts = TokenCounts()
    batch = _pad(_rows(3, seed=1))
    with pytest.raises(RuntimeError, match="accumulate_train_batch_on_tokens=True"):
        counts.loss(_model()(batch["input_ids"]), batch)
    counts(_pad(_rows(3, seed=2)))  # the DataSpec asked about another batch
    with pytest.raises(RuntimeError, match="get_num_tokens_in_batch=counts"):
        counts.loss(_model()(batch["input_ids"]), batch)


def test_checking_stops_and_keeps_no_batch() -> None:
    counts = TokenCounts(check=1)
    model = _model()
    first, second = _pad(_rows(2, seed=3)), _pad(_rows(2, seed=4))
    counts(first)
    counts.loss(model(first["input_ids"]), first)
    counts(second)
    assert counts._last is None  # nothing held once checking is over
    out = counts.loss(model(second["input_ids"]), second)[
        "total"
    ]  # unchecked: no DataSpec call needed
    assert out.dtype == torch.float64 and counts.checked == 1


def test_a_micro_batch_without_targets_has_loss_zero() -> None:
    counts = TokenCounts()
    batch = {"input_ids": torch.tensor([[3]]), "labels": torch.tensor([[3]])}  # no target
    assert counts(batch)["loss_generating"] == 0
    out = counts.loss(_model()(batch["input_ids"]), batch)["total"]
    assert float(out) == 0.0 and torch.isfinite(out)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"shift": 1}, "shift must be"), ({"check": -1}, "check must be"), ({"check": True}, "check")],
)
def test_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TokenCounts(**kwargs)


def test_a_missing_labels_key_names_the_option() -> None:
    with pytest.raises(ValueError, match=r"labels='target'.*pass labels="):
        TokenCounts(labels="target")({"labels": torch.zeros(1, 2)})

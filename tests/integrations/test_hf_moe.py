"""``fullbatch.hf.ExactTrainer`` on a transformers MoE model: the load-balancing loss is the
window's (a no-grad pre-pass of routing counts), so one accumulated step equals one forward of
the whole window (token-mean cross-entropy + coef · transformers' pooled load-balancing loss);
the stock Trainer, which adds each micro-batch's own aux term, is measurably off."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
import torch.nn.functional as F
import transformers

import fullbatch.hf as fbhf
from _dist import run_ranks, values
from _moe_cases import (
    COEF,
    VOCAB,
    aux64,
    forward,
    make_moe,
    moe_rows,
    reference,
    rel_err,
    trainer_rank,
    trainer_step,
)

LENGTHS = (7, 3, 5, 7, 2, 6)  # real tokens per row: uneven micro-batches of 2 rows


def _summed_reference(model: Any, rows: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The same full batch, its loss *summed* over the tokens, backpropagated and divided by
    the count afterwards (plain PyTorch): Mixtral's RMSNorm computes in float32 inside, so
    this rounds differently from the mean's backward (4e-8 here), as ExactTrainer does."""
    out = forward(model, rows)
    labels = rows["labels"][:, 1:]
    n = int((labels != -100).sum())
    logits = out.logits[:, :-1].reshape(-1, VOCAB)
    ce = F.cross_entropy(logits, labels.reshape(-1), ignore_index=-100, reduction="sum")
    (ce + n * COEF * aux64(out.router_logits, rows["attention_mask"])).backward()
    return [torch.zeros_like(p) if p.grad is None else p.grad / n for p in model.parameters()]


def test_exact_trainer_moe_step_equals_full_batch(tmp_path: Any) -> None:
    model = make_moe("mixtral")
    model.config.output_router_logits = True  # the stock loss then adds coef · aux
    rows = moe_rows(LENGTHS, seed=1)
    want, _ = reference(copy.deepcopy(model), rows)  # checks transformers' own loss agrees
    summed = _summed_reference(copy.deepcopy(model), rows)
    stock = trainer_step(copy.deepcopy(model), transformers.Trainer, str(tmp_path), LENGTHS)
    got = trainer_step(model, fbhf.ExactTrainer, str(tmp_path), LENGTHS, loss="causal_lm")
    assert rel_err(got, summed) < 1e-10, rel_err(got, summed)  # rounding only
    assert rel_err(got, want) < 1e-7, rel_err(got, want)  # the float32 RMSNorm inside
    assert rel_err(stock, want) > 1e-3, rel_err(stock, want)  # the control: per micro-batch


def test_exact_trainer_runs_one_timed_pre_pass_per_window(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two windows: two pre-passes, each over its window's 3 micro-batches; the time each took
    is summed in ``trainer.fb_stats_seconds``."""
    from fullbatch.hf import _trainer

    seen: list[tuple[int, float]] = []
    trainers: list[Any] = []
    real = _trainer.window_routing

    def counted(*args: Any) -> Any:
        routing = real(*args)
        seen.append((len(args[2]), routing.seconds))
        return routing

    class Recorded(fbhf.ExactTrainer):
        def train(self, *args: Any, **kwargs: Any) -> Any:
            trainers.append(self)
            self.args.max_steps = 2  # two windows of the same rows
            return super().train(*args, **kwargs)

    monkeypatch.setattr(_trainer, "window_routing", counted)
    model = make_moe("mixtral")
    model.config.output_router_logits = True
    trainer_step(model, Recorded, str(tmp_path), LENGTHS, loss="causal_lm")
    assert [k for k, _ in seen] == [3, 3], seen
    assert all(s > 0 for _, s in seen), seen
    assert trainers[0].fb_stats_seconds == pytest.approx(sum(s for _, s in seen))


def test_exact_trainer_without_router_logits_adds_no_aux(tmp_path: Any) -> None:
    """``output_router_logits=False``: transformers adds no aux term, nor does ExactTrainer."""
    model = make_moe("mixtral")
    assert fbhf.ExactTrainer.__module__ == "fullbatch.hf"
    from fullbatch.hf._moe import moe_aux_of

    assert moe_aux_of(model) is None
    model.config.output_router_logits = True
    aux = moe_aux_of(model)
    assert aux is not None and (aux.coef, aux.top_k) == (0.25, 2)


def test_exact_trainer_moe_two_ddp_ranks(tmp_path: Any) -> None:
    """Two gloo ranks, 2 micro-batches each of uneven rows: the routing counts and the token
    count are the window's over both ranks; every rank's step equals the full batch's."""
    lengths = (7, 3, 5, 7, 2, 6, 4, 1)
    model = make_moe("mixtral")
    model.config.output_router_logits = True
    rows = moe_rows(lengths, seed=1)
    want, _ = reference(copy.deepcopy(model), rows)
    summed = _summed_reference(model, rows)
    got = values(run_ranks(trainer_rank, 2, lengths, deadline=150.0))
    for rank, applied in enumerate(got):
        assert rel_err(applied, summed) < 1e-10, (rank, rel_err(applied, summed))
        assert rel_err(applied, want) < 1e-7, (rank, rel_err(applied, want))


def test_subclass_with_its_own_loss_is_refused_on_moe(tmp_path: Any) -> None:
    """Only ExactTrainer's own exact_loss adds the window's aux term: a subclass replacing it
    on a model with a router aux loss would train without it, so it is refused."""

    class Own(fbhf.ExactTrainer):
        def exact_loss(self, model: Any, inputs: dict[str, Any]) -> tuple[Any, Any]:
            raise AssertionError("never reached")

    model = make_moe("mixtral")
    model.config.output_router_logits = True
    with pytest.raises(ValueError, match="router auxiliary loss"):
        trainer_step(model, Own, str(tmp_path), LENGTHS)

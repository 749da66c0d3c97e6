"""Window hooks run once per window on the full-batch gradient (float64), however many
backward calls the window had: three per micro-batch here, locally and on 2 DDP ranks."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import _dist_cases as cases
import fullbatch as fb
from _dist import run_ranks, values
from conftest import (
    IGNORE,
    Batch,
    class_batch,
    full_batch_reference,
    lm_batch,
    make_lm,
    params,
    rel_err,
    split_uneven,
)

RTOL = 1e-10
LENGTHS = [7, 3, 9, 1, 5, 6, 2, 8]


def z_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    keep = labels[:, 1:] != IGNORE
    return (torch.logsumexp(logits[:, :-1], dim=-1) ** 2)[keep].sum()


def square_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    keep = labels[:, 1:] != IGNORE
    return logits[:, :-1].square().mean(dim=-1)[keep].sum()


def objective(m: nn.Module, b: Batch) -> torch.Tensor:
    """Plain PyTorch: three terms over the same predicted tokens, divided by their count."""
    logits = m(b["input_ids"])
    ce = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]),
        b["labels"][:, 1:].reshape(-1),
        ignore_index=IGNORE,
        reduction="sum",
    )
    n = (b["labels"][:, 1:] != IGNORE).sum()
    return (ce + 1e-2 * z_sum(logits, b["labels"]) + 0.1 * square_sum(logits, b["labels"])) / n


def three_backwards(model: nn.Module, window: fb.Window, micro: Batch) -> None:
    """One micro-batch, three backward calls: the loss terms' hooks would fire three times."""
    logits = model(micro["input_ids"])
    ce_sum, n = fb.causal_lm_loss(logits, micro["labels"])
    window.backward(ce_sum, n, retain_graph=True)
    window.backward(1e-2 * z_sum(logits, micro["labels"]), 0, retain_graph=True)
    window.backward(0.1 * square_sum(logits, micro["labels"]), 0)


def grads_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def windows(n: int) -> list[Batch]:
    return [lm_batch(LENGTHS, seed=i, ignore_frac=0.2) for i in range(n)]


@pytest.mark.parametrize("max_grad_norm", [None, 0.05])
def test_hook_sees_full_batch_gradient_once_per_window(max_grad_norm: float | None) -> None:
    data = windows(3)
    model = make_lm()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    seen: list[list[torch.Tensor]] = []
    refs, updates, norms = [], [], []
    with fb.Accumulator(model, opt, micro_batch_size=3, max_grad_norm=max_grad_norm) as acc:
        acc.register_window_hook(lambda: seen.append(grads_of(model)))
        for window in acc.windows(data):
            refs.append(full_batch_reference(model, data[window.index], objective))
            before = params(model)
            for micro in window:
                three_backwards(model, window, micro)
            stats = window.step()
            assert len(seen) == window.index + 1  # once per window, not per backward (9 here)
            assert not stats.skipped and stats.micro_batches == 3
            updates.append([b - a for b, a in zip(before, params(model), strict=True)])
            norms.append(stats.grad_norm)
    assert len(seen) == 3
    for got, ref, update, norm in zip(seen, refs, updates, norms, strict=True):
        assert rel_err(got, ref.grads) < RTOL  # normalized, and before clipping
        assert norm == pytest.approx(ref.grad_norm, rel=RTOL)
        clip = 1.0 if max_grad_norm is None else min(1.0, max_grad_norm / (norm + 1e-6))
        assert clip < 1.0 or max_grad_norm is None
        assert rel_err(update, [g * clip for g in ref.grads]) < RTOL  # clipped after the hook


def test_hook_sees_unscaled_gradients_with_a_grad_scaler() -> None:
    batch = lm_batch(LENGTHS, seed=4)
    model = make_lm()
    ref = full_batch_reference(model, batch, objective)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    seen: list[list[torch.Tensor]] = []
    with fb.Accumulator(model, opt, micro_batches=4, scaler=scaler) as acc:
        acc.register_window_hook(lambda: seen.append(grads_of(model)))
        for window in acc.windows(split_uneven(batch, [2, 3, 1, 2])):
            for micro in window:
                three_backwards(model, window, micro)
            window.step()
    assert len(seen) == 1
    assert rel_err(seen[0], ref.grads) < RTOL


def test_hook_may_modify_gradients_in_place() -> None:
    """What a hook writes is what the optimizer steps with (e.g. gradient noise, masking)."""
    batch = class_batch(6, seed=2)
    model = nn.Linear(6, 5).double()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    before = params(model)
    with fb.Accumulator(model, opt, micro_batch_size=2) as acc:
        acc.register_window_hook(lambda: model.bias.grad.zero_())
        for window in acc.windows([batch]):
            for micro in window:
                window.backward(*fb.cross_entropy_sum(model(micro["x"]), micro["y"]))
            window.step()
    assert torch.equal(model.bias.detach(), before[1])
    assert not torch.equal(model.weight.detach(), before[0])


def test_hooks_run_in_order_and_remove_stops_them() -> None:
    data = [class_batch(4, seed=i) for i in range(3)]
    model = nn.Linear(6, 5).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls: list[str] = []
    with fb.Accumulator(model, opt, micro_batch_size=2) as acc:
        first = acc.register_window_hook(lambda: calls.append("a"))
        acc.register_window_hook(lambda: calls.append("b"))
        for window in acc.windows(data):
            for micro in window:
                window.backward(*fb.cross_entropy_sum(model(micro["x"]), micro["y"]))
            window.step()
            if window.index == 0:
                first.remove()
                first.remove()  # removing twice is harmless, as with torch's handles
    assert calls == ["a", "b", "b", "b"]


def test_hook_not_called_on_skipped_or_discarded_windows() -> None:
    data = [class_batch(4, seed=i) for i in range(4)]
    data[1]["y"][:] = IGNORE  # zero items
    model = nn.Linear(6, 5).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls: list[int] = []
    stats = []
    with fb.Accumulator(model, opt, micro_batch_size=2) as acc:
        acc.register_window_hook(lambda: calls.append(acc.steps))
        for window in acc.windows(data):
            for micro in window:
                loss_sum, n = fb.cross_entropy_sum(model(micro["x"]), micro["y"])
                if window.index == 2:
                    loss_sum = loss_sum * math.inf  # non-finite loss
                window.backward(loss_sum, n)
            if window.index == 3:
                window.discard()
                continue
            skips = window.index in (1, 2)
            with pytest.warns(RuntimeWarning) if skips else contextlib.nullcontext():
                stats.append(window.step())
    assert [s.skipped for s in stats] == [False, True, True]
    assert calls == [0]  # called before the step of window 0 only


def test_register_window_hook_refuses_a_non_callable() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with fb.Accumulator(model, opt, micro_batches=2) as acc, pytest.raises(ValueError) as info:
        acc.register_window_hook(model.weight)  # type: ignore[arg-type]
    assert "callable taking no arguments" in str(info.value)


# -- DDP: two gloo ranks, three backward calls per micro-batch, ddp_sync="step" --------------

LAYOUT = [[3, 2, 4], [1, 5]]


def ddp_three_backwards(rank: int, world: int) -> dict:
    model = cases.wrap(cases.make_model(), "ddp")
    opt = cases.make_optimizer(model.parameters())
    seen: list[torch.Tensor] = []

    def hook() -> None:
        seen.append(torch.cat([p.grad.detach().reshape(-1) for p in model.parameters()]))

    with fb.Accumulator(model, opt, micro_batches=2, ddp_sync="step") as acc:
        acc.register_window_hook(hook)
        for window in acc.windows(cases.rank_data(rank, LAYOUT)):
            for micro in window:
                out = model(micro["x"])
                ce, n = fb.cross_entropy_sum(out, micro["y"])
                keep = micro["y"] != IGNORE
                window.backward(ce, n, retain_graph=True)
                window.backward(0.1 * out.square().mean(dim=1)[keep].sum(), 0, retain_graph=True)
                window.backward(0.01 * out.sum(dim=1)[keep].sum(), 0)
            window.step()
    return {"seen": seen}


def ddp_reference() -> list[torch.Tensor]:
    """Plain float64 full-batch gradients of the same objective, window by window."""
    model = cases.make_model()
    opt = cases.make_optimizer(model.parameters())
    out = []
    for window in cases.reference_windows(LAYOUT, 2):
        x = torch.cat([m["x"] for m in window])
        y = torch.cat([m["y"] for m in window])
        keep = y != IGNORE
        logits = model(x)
        ce = F.cross_entropy(logits, y, ignore_index=IGNORE, reduction="sum")
        aux = 0.1 * logits.square().mean(dim=1)[keep].sum() + 0.01 * logits.sum(dim=1)[keep].sum()
        opt.zero_grad()
        ((ce + aux) / keep.sum()).backward()
        out.append(torch.cat([p.grad.reshape(-1).clone() for p in model.parameters()]))
        opt.step()
    return out


@pytest.mark.timeout(180)
def test_ddp_hook_sees_synced_full_batch_gradient_on_every_rank() -> None:
    results = values(run_ranks(ddp_three_backwards, 2))
    reference = ddp_reference()
    assert len(reference) == 2
    for rank, res in enumerate(results):
        assert len(res["seen"]) == len(reference), rank  # once per window on every rank
        for got, want in zip(res["seen"], reference, strict=True):
            err = float((got - want).abs().max() / want.abs().max())
            assert err < RTOL, (rank, err)
    for a, b in zip(results[0]["seen"], results[1]["seen"], strict=True):
        assert torch.equal(a, b)

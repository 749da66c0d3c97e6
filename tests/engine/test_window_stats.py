"""``window.stats``: the MoE load-balancing loss exact under accumulation (float64, against a
full batch of the stock objective), and a statistic never taken twice: a second call,
activation checkpointing, an "auto" retry, a mid-window resume."""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch

import fullbatch as fb
from _moe_cases import (
    FAMILIES,
    exact_share,
    make_moe,
    moe_rows,
    reference,
    rel_err,
    routing,
    split,
    tokens,
    update,
)

pytest.importorskip("transformers")

LENGTHS = [7, 3, 5, 6, 2, 7, 4]
SIZES = [1, 4, 2]  # uneven micro-batches
RTOL = 1e-12


def train_exact(model: Any, micros: list[dict], calls: list[int] | None = None, **kw: Any) -> Any:
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    stat = routing(model)

    def counted(micro: dict) -> Any:
        if calls is not None:
            calls.append(micro["input_ids"].shape[0])
        return stat(micro)

    acc = fb.Accumulator(model, opt, micro_batches=len(micros), counts=tokens(), **kw)
    for window in acc.windows(micros):
        counts = window.stats(counted)
        assert window.stats(counted) is counts  # a second call takes nothing
        for micro in window:
            window.backward(exact_share(model, window, counts, micro))
        stats = window.step()
    return update(before, model), stats


@pytest.mark.parametrize("family", FAMILIES)
def test_moe_load_balancing_is_exact(family: str) -> None:
    rows = moe_rows(LENGTHS, seed=1)
    model = make_moe(family)
    grads, loss = reference(copy.deepcopy(model), rows)
    calls: list[int] = []
    got, stats = train_exact(model, split(rows, SIZES), calls)
    assert rel_err(got, grads) < RTOL
    assert abs(stats.loss - loss) < RTOL * loss
    assert calls == SIZES  # one pre-pass forward per micro-batch
    assert stats.stats_seconds > 0


def test_stock_per_micro_batch_loss_is_not_exact() -> None:
    """The same loop with each micro-batch's own counts (what a forward computes) is off:
    the test above can fail."""
    rows = moe_rows(LENGTHS, seed=1)
    model = make_moe("mixtral")
    grads, _ = reference(copy.deepcopy(model), rows)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    acc = fb.Accumulator(model, opt, micro_batches=3, counts=tokens())
    stat = routing(model)
    for window in acc.windows(split(rows, SIZES)):
        for micro in window:
            window.backward(exact_share(model, window, stat(micro), micro))
        window.step()
    assert rel_err(update(before, model), grads) > 1e-4


def test_exact_under_activation_checkpointing() -> None:
    rows = moe_rows(LENGTHS, seed=2)
    model = make_moe("qwen3_moe")
    grads, _ = reference(copy.deepcopy(model), rows)
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # its name before transformers 5.2x
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()
    got, _ = train_exact(model, split(rows, SIZES))
    assert rel_err(got, grads) < RTOL


class _Fits(torch.nn.Module):
    """Raises OOM when a forward with grad sees more than ``rows`` rows (test_auto.py's way)."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.rows = rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.shape[0] > self.rows:
            raise torch.OutOfMemoryError(f"{x.shape[0]} rows do not fit")
        return x


def test_auto_retry_keeps_the_statistic() -> None:
    """micro_batch_size="auto": the training forward runs out of memory and the window is
    re-run at half the size; the pre-pass ran once, and the step is still exact."""
    rows = moe_rows(LENGTHS, seed=3)
    model = make_moe("olmoe")
    grads, loss = reference(copy.deepcopy(model), rows)
    fits = _Fits(3)
    model.model.embed_tokens.register_forward_hook(lambda m, i, o: fits(o))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    acc = fb.Accumulator(model, opt, micro_batch_size="auto", counts=tokens())
    stat, calls = routing(model), []

    def counted(micro: dict) -> Any:
        calls.append(micro["input_ids"].shape[0])
        return stat(micro)

    for window in acc.windows([rows]):
        counts = window.stats(counted)
        stats = window.run(lambda m, w=window, c=counts: exact_share(model, w, c, m))
    assert stats.retries >= 1 and acc.micro_batch_size <= 3
    assert calls == [len(LENGTHS)]  # one pre-pass, not one per attempt
    assert rel_err(update(before, model), grads) < RTOL
    assert abs(stats.loss - loss) < RTOL * loss


def test_out_of_memory_in_the_pre_pass_runs_it_in_halves() -> None:
    """micro_batch_size="auto": the first window is one whole micro-batch, whose no-grad
    pre-pass forward runs out of memory too; the pre-pass re-runs it in halves (7 rows -> 4,
    3 -> 2, 2, 2, 1), the statistic is the same sum, and the step is exact."""
    rows = moe_rows(LENGTHS, seed=3)
    model = make_moe("olmoe")
    grads, loss = reference(copy.deepcopy(model), rows)

    def fits(_: Any, __: Any, out: torch.Tensor) -> None:
        if out.shape[0] > 2:
            raise torch.OutOfMemoryError(f"{out.shape[0]} rows do not fit")

    model.model.embed_tokens.register_forward_hook(fits)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    acc = fb.Accumulator(model, opt, micro_batch_size="auto", counts=tokens())
    stat, calls = routing(model), []

    def counted(micro: dict) -> Any:
        calls.append(micro["input_ids"].shape[0])
        return stat(micro)

    for window in acc.windows([rows]):
        counts = window.stats(counted)
        stats = window.run(lambda m, w=window, c=counts: exact_share(model, w, c, m))
    assert calls == [7, 4, 2, 2, 3, 2, 1]  # tried whole, then halves until they fit
    assert rel_err(update(before, model), grads) < RTOL
    assert abs(stats.loss - loss) < RTOL * loss


def test_out_of_memory_at_one_row_in_the_pre_pass_raises() -> None:
    model = torch.nn.Linear(2, 2)
    acc = fb.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batches=1)
    before = model.weight.detach().clone()

    def too_big(micro: torch.Tensor) -> torch.Tensor:
        raise torch.OutOfMemoryError(f"{micro.shape[0]} rows do not fit")

    with pytest.raises(torch.OutOfMemoryError, match=r"^1 rows do not fit"):
        for window in acc.windows([torch.ones(3, 2)]):
            window.stats(too_big)
    assert torch.equal(model.weight, before)


def test_out_of_memory_in_an_all_gathering_pre_pass_names_the_fix() -> None:
    """Under FSDP2 (forwards that all-gather on every rank) the pre-pass cannot re-run one
    rank's micro-batch in halves: the error propagates at once, naming why and the fix."""
    from fullbatch._base._prepass import halving
    from fullbatch._engine._stats_pass import ALL_GATHERS

    calls: list[int] = []

    def too_big(micro: torch.Tensor) -> torch.Tensor:
        calls.append(micro.shape[0])
        raise torch.OutOfMemoryError(f"{micro.shape[0]} rows do not fit")

    with pytest.raises(torch.OutOfMemoryError, match=r"FSDP2's all-gathers .* micro_batch_size"):
        halving(too_big, torch.ones(4, 2), split=False, collectives=ALL_GATHERS)
    assert calls == [4]  # no halves tried: the other ranks would wait in their all-gathers
    fits = halving(lambda m: m.sum(0), torch.ones(4, 2), split=False, collectives=ALL_GATHERS)
    assert fits[0].tolist() == [4.0, 4.0]


@pytest.mark.parametrize("done", [1, 2])
def test_mid_window_resume_uses_the_saved_statistic(done: int) -> None:
    """A state saved inside a window holds the statistic; the resumed window never runs a
    pre-pass over the micro-batches left (which would count only those)."""
    rows = moe_rows(LENGTHS, seed=4)
    micros = split(rows, SIZES)
    model = make_moe("mixtral")
    grads, _ = reference(copy.deepcopy(model), rows)
    before = [p.detach().clone() for p in model.parameters()]

    def objs(m: Any) -> tuple[Any, Any]:
        opt = torch.optim.SGD(m.parameters(), lr=1.0)
        return opt, fb.Accumulator(m, opt, micro_batches=3, counts=tokens())

    opt, acc = objs(model)
    stat = routing(model)
    for window in acc.windows(micros):
        counts = window.stats(stat, key="routing")
        for j, micro in enumerate(window):
            window.backward(exact_share(model, window, counts, micro))
            if j + 1 == done:
                break
        break
    buf = io.BytesIO()
    torch.save([model.state_dict(), opt.state_dict(), acc.state_dict()], buf)
    buf.seek(0)
    states = torch.load(buf, weights_only=True)
    acc.close()
    fresh = make_moe("mixtral", seed=9)
    fresh.load_state_dict(states[0])
    opt2, acc2 = objs(fresh)
    opt2.load_state_dict(states[1])
    acc2.load_state_dict(states[2])

    def refuse(micro: dict) -> Any:
        raise AssertionError("the resumed window ran a pre-pass")

    for window in acc2.windows(micros[states[2]["loader_items"] :]):
        counts = window.stats(refuse, key="routing")
        for micro in window:
            window.backward(exact_share(fresh, window, counts, micro))
        window.step()
    assert rel_err(update(before, fresh), grads) < RTOL


def test_a_statistic_after_the_first_backward_raises() -> None:
    rows = moe_rows(LENGTHS[:3], seed=5)
    model = make_moe("mixtral", layers=1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    acc = fb.Accumulator(model, opt, micro_batches=3, counts=tokens())
    stat = routing(model)
    for window in acc.windows(split(rows, [1, 1, 1])):
        for _micro in window:
            with pytest.raises(RuntimeError, match="before the first"):
                window.stats(stat)
            window.discard()
            break


def test_a_resumed_window_without_the_statistic_raises() -> None:
    rows = moe_rows(LENGTHS[:3], seed=5)
    micros = split(rows, [1, 1, 1])
    model = make_moe("mixtral", layers=1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    acc = fb.Accumulator(model, opt, micro_batches=3, counts=tokens())
    stat = routing(model)
    for window in acc.windows(micros):
        for micro in window:
            window.backward(exact_share(model, window, stat(micro), micro))
            break
        break
    state = acc.state_dict()
    acc.close()
    opt.zero_grad(set_to_none=True)  # the state holds them
    acc2 = fb.Accumulator(model, opt, micro_batches=3, counts=tokens())
    acc2.load_state_dict(state)
    for window in acc2.windows(micros):
        with pytest.raises(RuntimeError, match="1 yielded"):
            window.stats(stat)
        break


def test_bad_returns_and_reductions_raise() -> None:
    model = torch.nn.Linear(2, 1).double()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    acc = fb.Accumulator(model, opt, micro_batches=2)
    data = [{"x": torch.ones(1, 2, dtype=torch.float64)}] * 2
    for window in acc.windows(data):
        with pytest.raises(ValueError, match="reduce="):
            window.stats(lambda m: m["x"], reduce="mean")
        with pytest.raises(ValueError, match="must return a tensor"):
            window.stats(lambda m: 3.0)
        got = window.stats(lambda m: {"s": m["x"].sum()})
        assert got["s"].item() == 4.0 and got["s"].dtype == torch.float64
        window.discard()


@pytest.mark.parametrize("family", FAMILIES)
def test_verify_reports_each_choice(family: str) -> None:
    model = make_moe(family)
    report = fb.verify(model, moe_rows(LENGTHS, seed=6), None, micro_batch_size=2, moe=True)
    errors = list(report.errors.values())
    assert report.passed and errors[0] < 1e-12, str(report)
    assert errors[1] > 1e-6 and errors[2] > 1e-6  # running mean and stock are measurably off
    assert "running mean" in str(report) and "per micro-batch (stock)" in str(report)
    with pytest.raises(ValueError, match="loss_fn=None"):
        fb.verify(model, moe_rows(LENGTHS), lambda m, b: b, micro_batch_size=2, moe=True)


def _dropout_step(with_stats: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1)
    ).double()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    data = [{"x": torch.randn(2, 3, dtype=torch.float64)} for _ in range(3)]
    torch.manual_seed(1)
    with fb.Accumulator(model, opt, micro_batches=3) as acc:
        for window in acc.windows(data):
            if with_stats:
                window.stats(lambda m: model(m["x"]).sum())  # draws dropout masks too
            for m in window:
                window.backward(model(m["x"]).sum(), 2)
            window.step()
    return [p.detach().clone() for p in model.parameters()]


def test_the_pre_pass_leaves_the_training_dropout_masks_alone() -> None:
    """The RNG state is restored after the pre-pass: the step is bitwise the one without it."""
    for a, b in zip(_dropout_step(False), _dropout_step(True), strict=True):
        assert torch.equal(a, b)


def test_batchnorm_window_is_refused() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.BatchNorm1d(4)).double()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    acc = fb.Accumulator(model, opt, micro_batches=2, batchnorm="window")
    data = [{"x": torch.randn(3, 2, dtype=torch.float64)} for _ in range(2)]
    for window in acc.windows(data):
        with pytest.raises(ValueError, match="batchnorm='window'"):
            window.stats(lambda m: model(m["x"]).sum())
        window.discard()

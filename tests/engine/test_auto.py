"""``micro_batch_size="auto"``: an out-of-memory error halves the size and re-runs the window.

The model raises ``torch.OutOfMemoryError`` when a forward sees more rows than it "fits"
(a threshold). Everything is float64 on CPU, with dropout and BatchNorm, so RNG state and
running statistics must be restored exactly: the result must be *bitwise* equal to a run
that used the found size from the start.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import fullbatch as fb
from _auto_cases import TokenLM
from conftest import class_batch, params


class Fits(nn.Module):
    """Raises OOM when a forward (in training mode, with grad) sees more than ``rows`` rows."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.rows = rows
        self.calls: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(x.shape[0])
        if x.shape[0] > self.rows:
            raise torch.OutOfMemoryError(f"{x.shape[0]} rows do not fit (threshold {self.rows})")
        return x


def make_model(rows: int, bn: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.3)]
    if bn:
        layers.append(nn.BatchNorm1d(16))
    layers += [Fits(rows), nn.Linear(16, 5)]
    return nn.Sequential(*layers).double()


def threshold(model: nn.Module) -> Fits:
    return next(m for m in model.modules() if isinstance(m, Fits))


def windows(rows=(16, 16, 10, 16)) -> list[dict]:
    return [class_batch(n, seed=i, ignore=(1,)) for i, n in enumerate(rows)]


def train(model, data, size, **kwargs):
    """``window.run`` with ``micro_batch_size=size``; StepStats, parameters, buffers, sizes."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    out = []
    torch.manual_seed(123)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # BatchNorm without batchnorm="window"
        acc = fb.Accumulator(model, opt, micro_batch_size=size, **kwargs)
    with acc:
        assert acc.micro_batch_size == (None if size == "auto" else size)
        for window in acc.windows(data):
            stats = window.run(lambda m: fb.cross_entropy_sum(model(m["x"]), m["y"]))
            bufs = [b.clone() for b in model.buffers()]
            out.append((stats, params(model), bufs, acc.micro_batch_size))
            assert all(p.grad is None for p in model.parameters())
    return out


def _equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(
    ("fits", "found", "retries"),
    [(3, 2, 3), (4, 4, 2), (16, 16, 0), (5, 4, 2), (1, 1, 4)],
)
@pytest.mark.parametrize("bn", [None, "plain", "window"])
def test_auto_equals_the_found_size_from_the_start(fits, found, retries, bn) -> None:
    if bn and found == 1:
        pytest.skip("BatchNorm needs more than one row per micro-batch")
    kwargs = {"batchnorm": "window"} if bn == "window" else {}
    model = make_model(fits, bn=bn is not None)
    ref = copy.deepcopy(model)
    got = train(model, windows(), "auto", **kwargs)
    threshold(ref).rows = 10**9  # the reference never runs out of memory
    want = train(ref, windows(), found, **kwargs)
    assert [s.retries for s, *_ in got] == [retries, 0, 0, 0]
    assert retries <= 4  # log2(16 rows)
    assert [size for *_, size in got] == [found, found, min(found, 10), found]
    for (gs, gp, gb, _), (ws, wp, wb, _) in zip(got, want, strict=True):
        assert gs == dataclasses_replace(ws, retries=gs.retries)
        assert _equal(gp, wp) and _equal(gb, wb)
    # within 2x of the largest size that fits
    assert fits // 2 < found <= fits


def test_ddp_sync_last_with_auto_is_fine_without_ddp() -> None:
    """``ddp_sync`` only concerns DDP: "last" with "auto" on a plain model trains as without."""
    model = make_model(3)
    ref = copy.deepcopy(model)
    got = train(model, windows(), "auto", ddp_sync="last")
    want = train(ref, windows(), "auto")
    for (gs, gp, gb, gz), (ws, wp, wb, wz) in zip(got, want, strict=True):
        assert gs == ws and gz == wz and _equal(gp, wp) and _equal(gb, wb)


def dataclasses_replace(stats, **changes):
    import dataclasses

    return dataclasses.replace(stats, **changes)


def test_the_size_is_found_once_and_kept() -> None:
    model = make_model(5)
    got = train(model, windows((16, 16, 32, 4)), "auto")
    # 16 -> 8 -> 4 once; the later windows run at 4 (the short one whole), no retries
    assert [s.retries for s, *_ in got] == [2, 0, 0, 0]
    assert [s.micro_batches for s, *_ in got] == [4, 4, 8, 1]
    calls = threshold(model).calls
    assert calls[:3] == [16, 8, 4]  # each failed attempt stops at its first micro-batch


def test_oom_at_one_row_reraises_the_original_error() -> None:
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = params(model)
    with fb.Accumulator(model, opt, micro_batch_size="auto") as acc:
        for window in acc.windows(windows((8,))):
            with pytest.raises(torch.OutOfMemoryError, match=r"1 rows do not fit"):
                window.run(lambda m: fb.cross_entropy_sum(model(m["x"]), m["y"]))
        assert acc.micro_batch_size == 1
    assert threshold(model).calls == [8, 4, 2, 1]
    assert all(p.grad is None for p in model.parameters())
    assert _equal(params(model), before)


def test_grad_scaler_state_is_restored() -> None:
    model = make_model(3)
    ref = copy.deepcopy(model)
    threshold(ref).rows = 10**9
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1) for _ in "ab"]
    got = train(model, windows(), "auto", scaler=scalers[0])
    want = train(ref, windows(), 2, scaler=scalers[1])
    assert scalers[0].state_dict() == scalers[1].state_dict()
    for (_, gp, *_), (_, wp, *_) in zip(got, want, strict=True):
        assert _equal(gp, wp)


def test_other_errors_propagate_without_retry() -> None:
    model = make_model(3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with fb.Accumulator(model, opt, micro_batch_size="auto") as acc:
        for window in acc.windows(windows((8,))):

            def fn(m):
                raise KeyError("labels")

            with pytest.raises(KeyError):
                window.run(fn)
    assert all(p.grad is None for p in model.parameters())


# -- micro_batch_tokens="auto": the same machinery, with a token budget that halves ----------


def test_micro_batch_tokens_auto_equals_the_found_budget_and_the_full_batch() -> None:
    from conftest import lm_batch, rel_err

    data = [lm_batch([9, 3, 12, 5, 7, 2, 11, 4], seed=s, width=16) for s in range(3)]
    found = []

    def run(budget):
        model = TokenLM(tokens=20).double()
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        before = params(model)
        out = []
        with fb.Accumulator(model, opt, micro_batch_tokens=budget) as acc:
            assert acc.micro_batch_tokens == (None if budget == "auto" else budget)
            for window in acc.windows(data[:1]):
                out.append(
                    window.run(lambda m: fb.causal_lm_loss(model(m["input_ids"]), m["labels"]))
                )
                found.append(acc.micro_batch_tokens)
        return out, [b - a for b, a in zip(before, params(model), strict=True)]

    stats, update = run("auto")
    budget = found[0]
    assert budget is not None and budget <= 20 < 2 * budget  # within 2x of what fits
    assert stats[0].retries >= 1
    fixed_stats, fixed_update = run(budget)
    assert _equal(update, fixed_update) and fixed_stats[0].retries == 0
    ref_model = TokenLM(tokens=10**6).double()
    batch = data[0]
    logits = ref_model(batch["input_ids"])
    torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, 17), batch["labels"][:, 1:].reshape(-1)
    ).backward()
    assert rel_err(update, [p.grad for p in ref_model.parameters()]) < 1e-10

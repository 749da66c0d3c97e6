"""fp16 autocast on CPU with ``torch.amp.GradScaler("cpu")``: fullbatch's pre-normalized
backward (``c · loss_sum`` with ``c`` a power of two ≈ 1/N) skips no more windows than a
hand-written loop that backpropagates ``loss_sum / N``; raw sums overflow more often."""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fullbatch as fb

VOCAB, DIM, MAX_LEN = 256, 64, 128
ROWS, MICRO = 8, 3  # 8 rows per window, micro-batches of 3, 3, 2 rows
WINDOWS = 30
# Default growth (only the first windows can overflow) and a scaler that doubles its scale
# every 2 clean windows, so that every loop keeps probing the overflow boundary.
SCALERS = {
    "default": {"init_scale": 2.0**16, "growth_interval": 2000},
    "aggressive": {"init_scale": 2.0**16, "growth_interval": 2},
}


class SmallLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.up = nn.Linear(DIM, DIM)
        self.down = nn.Linear(DIM, DIM)
        self.out = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        return self.out(h + self.down(F.gelu(self.up(h))))


def corpus() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(WINDOWS):
        lengths = torch.randint(16, MAX_LEN + 1, (ROWS,), generator=g)
        real = torch.arange(MAX_LEN)[None] < lengths[:, None]
        ids = torch.randint(1, VOCAB, (ROWS, MAX_LEN), generator=g).masked_fill(~real, 0)
        out.append({"input_ids": ids, "labels": ids.masked_fill(~real, -100)})
    return out


def make_opt(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def forward(model, micro):
    with torch.autocast("cpu", dtype=torch.float16):
        logits = model(micro["input_ids"])
    assert logits.dtype == torch.float16
    return fb.causal_lm_loss(logits, micro["labels"])


def hand_written(model, windows, settings, normalize: bool) -> tuple[int, list[float]]:
    """The reference loop: backward of ``loss_sum / N`` (or the raw sum), same scaler."""
    opt = make_opt(model)
    scaler = torch.amp.GradScaler("cpu", **settings)
    skips, losses = 0, []
    for batch in windows:
        n_global = int((batch["labels"][:, 1:] != -100).sum())
        total = 0.0
        for i in range(0, ROWS, MICRO):
            loss_sum, _ = forward(model, {k: v[i : i + MICRO] for k, v in batch.items()})
            total += float(loss_sum.detach())
            scaler.scale(loss_sum / n_global if normalize else loss_sum).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skips += scaler.get_scale() < before  # the scale backs off exactly when it skipped
        opt.zero_grad(set_to_none=True)
        losses.append(total / n_global)
    return skips, losses


@functools.cache
def runs(name: str):
    """The three loops under one scaler setting (computed once per setting)."""
    settings = SCALERS[name]
    windows = corpus()
    torch.manual_seed(0)
    model = SmallLM()
    opt_model = copy.deepcopy(model)
    opt = make_opt(opt_model)
    scaler = torch.amp.GradScaler("cpu", **settings)
    stats = []
    with fb.Accumulator(opt_model, opt, micro_batch_size=MICRO, scaler=scaler) as acc:
        for window in acc.windows(windows):
            for micro in window:
                window.backward(*forward(opt_model, micro))
            stats.append(window.step())
    normalized = hand_written(copy.deepcopy(model), windows, settings, normalize=True)
    raw = hand_written(copy.deepcopy(model), windows, settings, normalize=False)
    skips = sum(s.skipped for s in stats)
    print(
        f"\nfp16 ({name} scaler) skipped windows of {WINDOWS}: fullbatch {skips} "
        f"{[i for i, s in enumerate(stats) if s.skipped]}, loss_sum/N {normalized[0]}, "
        f"raw sums {raw[0]}"
    )
    return windows, stats, normalized, raw


@pytest.mark.parametrize(
    "name",
    [
        "default",
        "aggressive",
    ],
)
def test_fullbatch_skips_no_more_than_loss_over_n(name: str, record_property) -> None:
    _, stats, (ref_skips, _), (raw_skips, _) = runs(name)
    assert len(stats) == WINDOWS and all(s.micro_batches == 3 for s in stats)
    skips = sum(s.skipped for s in stats)
    record_property("fp16_skips_fullbatch", skips)
    record_property("fp16_skips_loss_over_n", ref_skips)
    record_property("fp16_skips_raw_sums", raw_skips)
    assert skips <= ref_skips


@pytest.mark.parametrize("name", sorted(SCALERS))
def test_same_training_as_the_reference_loop(name: str) -> None:
    _, stats, (_, ref_losses), _ = runs(name)
    # the reference loop's loss (before its own step) at the last window fullbatch stepped
    last = max(i for i, s in enumerate(stats) if not s.skipped)
    assert stats[last].loss == pytest.approx(ref_losses[last], rel=1e-3)


@pytest.mark.parametrize("name", sorted(SCALERS))
def test_raw_sums_skip_more(name: str) -> None:
    """DESIGN's motivation for pre-normalizing: raw loss sums overflow fp16 gradients."""
    _, _, (ref_skips, _), (raw_skips, _) = runs(name)
    assert raw_skips > ref_skips


@pytest.mark.parametrize("name", sorted(SCALERS))
def test_loss_scale_is_a_power_of_two_near_one_over_n(name: str) -> None:
    windows, stats, _, _ = runs(name)
    counts = [int((w["labels"][:, 1:] != -100).sum()) for w in windows]
    assert [s.count for s in stats] == counts
    for i, s in enumerate(stats):
        mantissa, _ = math.frexp(s.loss_scale)
        assert mantissa == 0.5 and s.loss_scale < 1, s.loss_scale
        if i == 0:  # estimated before any count is known: from the first micro-batch's size
            assert 1 / 16 <= s.loss_scale * counts[0] <= 2, (s.loss_scale, counts[0])
        else:  # fixed before the window's first backward: ≈ 1 / N of the previous window
            ratio = s.loss_scale * counts[i - 1]
            assert 0.5 <= ratio <= 2**0.5, (i, s.loss_scale, counts[i - 1])

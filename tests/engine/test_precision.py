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
from fullbatch._base._versions import FSDP2_CPU_TORCH, torch_version

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


# -- accumulate_dtype=torch.float32: bf16 parameters accumulate in float32 buffers ---------------

BF16 = torch.bfloat16
SPLITS = (1, 8, 32)


def bf16_lm() -> nn.Module:
    from conftest import TinyLM

    torch.manual_seed(0)
    return TinyLM(17, 8).to(BF16)


def lm_rows(seed: int, rows: int = 64, length: int = 16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 17, (rows, length), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def float32_reference(model: nn.Module, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The float32 full-batch gradient at the bf16 model's weights."""
    ref = copy.deepcopy(model).float()
    loss_sum, n = fb.causal_lm_loss(ref(batch["input_ids"]), batch["labels"])
    (loss_sum / n).backward()
    return [p.grad.detach().clone() for p in ref.parameters()]


def optimizer_grads(
    model: nn.Module, batch: dict[str, torch.Tensor], micro_batches: int, **options
) -> tuple[list[torch.Tensor], fb.StepStats]:
    """The gradients the optimizer receives from one window (an optimizer step pre-hook)."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    seen: list[torch.Tensor] = []
    opt.register_step_pre_hook(
        lambda o, a, k: seen.extend(p.grad.detach().clone() for p in model.parameters())
    )
    rows = batch["input_ids"].shape[0] // micro_batches
    with fb.Accumulator(model, opt, micro_batch_size=rows, **options) as acc:
        for window in acc.windows([batch]):
            for micro in window:
                window.backward(*fb.causal_lm_loss(model(micro["input_ids"]), micro["labels"]))
            stats = window.step()
    assert stats.micro_batches == micro_batches
    return seen, stats


def norm_rel_err(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    diff = sum(
        float((g.double() - w.double()).square().sum()) for g, w in zip(got, want, strict=True)
    )
    return math.sqrt(diff / sum(float(w.double().square().sum()) for w in want))


@functools.cache
def accumulate_errors() -> dict[str, dict[int, float]]:
    """Relative gradient error vs float32, per split, with and without the option (max of 2
    batches)."""
    model = bf16_lm()
    errors: dict[str, dict[int, float]] = {"bf16": {}, "fp32": {}}
    for seed in range(2):
        batch = lm_rows(seed)
        want = float32_reference(model, batch)
        for k in SPLITS:
            for name, dtype in (("bf16", None), ("fp32", torch.float32)):
                got, _ = optimizer_grads(model, batch, k, accumulate_dtype=dtype)
                assert all(g.dtype == BF16 for g in got)  # the optimizer gets the param dtype
                err = norm_rel_err(got, want)
                errors[name][k] = max(errors[name].get(k, 0.0), err)
    print(f"\nbf16 gradient error vs float32 by micro-batches {SPLITS}: {errors}")
    return errors


def test_accumulate_dtype_error_stays_flat_with_the_window() -> None:
    errors = accumulate_errors()["fp32"]
    assert max(errors.values()) <= 1.25 * errors[1], errors
    assert errors[32] < 5e-3  # one bf16 forward/backward and one final rounding


def test_accumulate_dtype_beats_bf16_accumulation_at_32_micro_batches() -> None:
    errors = accumulate_errors()
    assert errors["bf16"][32] > 1.3 * errors["bf16"][1]  # what the option fixes: growth
    assert errors["fp32"][32] < 0.7 * errors["bf16"][32], errors


def test_accumulate_dtype_buffers_sum_exactly_in_float32() -> None:
    """The buffer is the float32 sum of each backward's bf16 gradient: 512 additions of
    2^-8 give 2.0 (in bf16 the sum sticks at 1.0). Normalization by N=512 makes it 2^-8."""
    w = nn.Parameter(torch.zeros(4, dtype=BF16))
    model = nn.ParameterList([w])
    got = {}
    for dtype in (None, torch.float32):
        opt = torch.optim.SGD(model.parameters(), lr=0.0)

        def keep(o, a, k, d=dtype) -> None:
            got[d] = w.grad.clone()

        opt.register_step_pre_hook(keep)
        with fb.Accumulator(model, opt, micro_batches=512, accumulate_dtype=dtype) as acc:
            for window in acc.windows([None] * 512):
                for _ in window:
                    window.backward((w / 256).sum(), 1)
                window.step()
    assert float(got[torch.float32][0]) == 2.0**-8  # (512 · 2^-8) / 512, exact
    assert float(got[None][0]) == 2.0**-9  # bf16 accumulation lost half of it


class Mixed(nn.Module):
    """bf16 embedding and mixing layer, float32 output head."""

    def __init__(self) -> None:
        super().__init__()
        lm = bf16_lm()
        self.embed, self.mix, self.out = lm.embed, lm.mix, lm.out.float()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        return self.out((h + torch.tanh(self.mix(h))).float())


def test_accumulate_dtype_leaves_float32_parameters_alone() -> None:
    """Wider parameters are untouched: a float32 model trains bitwise as without the option,
    and in a mixed model the float32 parameters' gradients are bitwise the same too."""
    batch = lm_rows(3, rows=16)
    model32 = bf16_lm().float()
    plain, _ = optimizer_grads(model32, batch, 4)
    opted, _ = optimizer_grads(model32, batch, 4, accumulate_dtype=torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(plain, opted, strict=True))
    mixed = Mixed()
    plain, _ = optimizer_grads(mixed, batch, 4)
    opted, _ = optimizer_grads(mixed, batch, 4, accumulate_dtype=torch.float32)
    names = [n for n, _ in mixed.named_parameters()]
    for name, a, b in zip(names, plain, opted, strict=True):
        assert a.dtype == b.dtype
        if a.dtype == torch.float32:
            assert torch.equal(a, b), name


def test_accumulate_dtype_norm_and_clipping_from_float32() -> None:
    batch = lm_rows(4)
    model = bf16_lm()
    want = float32_reference(model, batch)
    ref_norm = math.sqrt(sum(float(w.double().square().sum()) for w in want))
    _, stats = optimizer_grads(model, batch, 8, accumulate_dtype=torch.float32)
    assert stats.grad_norm == pytest.approx(ref_norm, rel=1e-2)
    clipped, stats = optimizer_grads(
        model, batch, 8, accumulate_dtype=torch.float32, max_grad_norm=0.5 * ref_norm
    )
    got_norm = math.sqrt(sum(float(g.double().square().sum()) for g in clipped))
    assert got_norm == pytest.approx(0.5 * ref_norm, rel=1e-2)
    assert norm_rel_err(clipped, [w * 0.5 * ref_norm / stats.grad_norm for w in want]) < 5e-3


def test_accumulate_dtype_window_hook_sees_what_the_optimizer_gets() -> None:
    batch = lm_rows(5, rows=16)
    model = bf16_lm()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    hooked: list[torch.Tensor] = []
    stepped: list[torch.Tensor] = []
    opt.register_step_pre_hook(
        lambda o, a, k: stepped.extend(p.grad.clone() for p in model.parameters())
    )
    with fb.Accumulator(model, opt, micro_batch_size=4, accumulate_dtype=torch.float32) as acc:
        acc.register_window_hook(lambda: hooked.extend(p.grad.clone() for p in model.parameters()))
        for window in acc.windows([batch]):
            for micro in window:
                window.backward(*fb.causal_lm_loss(model(micro["input_ids"]), micro["labels"]))
            window.step()
    assert len(hooked) == len(stepped) == len(list(model.parameters()))
    assert all(h.dtype == BF16 and torch.equal(h, s) for h, s in zip(hooked, stepped, strict=True))


def test_accumulate_dtype_skipped_window_and_guard() -> None:
    """Skips clear the buffers (the next window starts from zero); a stray loss.backward()
    inside the window is still caught, although the buffered .grad is cleared each time."""
    model = bf16_lm()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    data = [lm_rows(6, rows=8), lm_rows(7, rows=8)]
    data[0]["labels"][:] = -100  # zero items: skipped
    with fb.Accumulator(model, opt, micro_batch_size=4, accumulate_dtype=torch.float32) as acc:
        for window in acc.windows(data):
            for micro in window:
                window.backward(*fb.causal_lm_loss(model(micro["input_ids"]), micro["labels"]))
            if window.index == 0:
                with pytest.warns(RuntimeWarning):
                    assert window.step().skipped
                buffers = acc._engine.grad_buffers
                assert buffers is not None and buffers.grads() == []
            else:
                assert not window.step().skipped
        for window in acc.windows([lm_rows(8, rows=8)]):
            for micro in window:
                loss_sum, n = fb.causal_lm_loss(model(micro["input_ids"]), micro["labels"])
                loss_sum.backward(retain_graph=True)  # a leftover of a hand-written loop
                with pytest.raises(RuntimeError, match="cleared or changed"):
                    window.backward(loss_sum, n)
                break
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"accumulate_dtype": "float32"}, "floating torch dtype, got 'float32'"),
        ({"accumulate_dtype": torch.int32}, "floating torch dtype, got torch.int32"),
        (
            {"accumulate_dtype": torch.float32, "scaler": torch.amp.GradScaler("cpu")},
            "GradScaler",
        ),
    ],
)
def test_accumulate_dtype_refusals(options: dict, match: str) -> None:
    model = bf16_lm()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=match):
        fb.Accumulator(model, opt, micro_batches=2, **options)
    assert not opt._optimizer_step_pre_hooks  # refused before registering anything


def _ddp_bf16(rank: int, world: int) -> dict:
    import _dist_cases as cases

    model = cases.make_model().to(BF16)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.0)
    try:
        fb.Accumulator(ddp, opt, micro_batches=2, accumulate_dtype=torch.float32)
        refused = ""
    except ValueError as error:
        refused = str(error)
    refused_fsdp = None  # FSDP2 on CPU needs torch >= 2.7 (pytorch#145935)
    if torch_version() >= FSDP2_CPU_TORCH:
        try:
            sharded = cases.wrap(cases.make_model(seed=1).to(BF16), "fsdp")
            fsdp_opt = torch.optim.SGD(sharded.parameters(), lr=0.0)
            fb.Accumulator(sharded, fsdp_opt, micro_batches=2, accumulate_dtype=torch.float32)
            refused_fsdp = ""
        except ValueError as error:
            refused_fsdp = str(error)
    seen: list[torch.Tensor] = []
    opt.register_step_pre_hook(
        lambda o, a, k: seen.append(
            torch.cat([p.grad.float().reshape(-1) for p in ddp.parameters()])
        )
    )
    layout = [[3, 2, 4, 1], [1, 5, 2]]
    options = {"ddp_sync": "step", "accumulate_dtype": torch.float32}
    with fb.Accumulator(ddp, opt, micro_batches=4, **options) as acc:
        for window in acc.windows(cases.rank_data(rank, layout)):
            for micro in window:
                window.backward(*fb.cross_entropy_sum(ddp(micro["x"].to(BF16)), micro["y"]))
            window.step()
    return {"refused": refused, "refused_fsdp": refused_fsdp, "seen": seen}


@pytest.mark.timeout(180)
def test_accumulate_dtype_under_ddp_needs_ddp_sync_step_and_is_synced() -> None:
    import _dist_cases as cases
    from _dist import run_ranks, values

    results = values(run_ranks(_ddp_bf16, 2))
    for res in results:
        assert "needs ddp_sync='step'" in res["refused"]
        if torch_version() >= FSDP2_CPU_TORCH:
            assert "under FSDP2 is not supported" in res["refused_fsdp"]
            assert "MixedPrecisionPolicy" in res["refused_fsdp"]
        assert len(res["seen"]) == 1
    assert torch.equal(results[0]["seen"][0], results[1]["seen"][0])  # synced on every rank
    # the float32 full-batch gradient of the union of both ranks' data, at the bf16 weights
    (window,) = cases.reference_windows([[3, 2, 4, 1], [1, 5, 2]], 4)
    ref = cases.make_model().to(BF16).float()
    x = torch.cat([m["x"] for m in window]).to(BF16).float()
    y = torch.cat([m["y"] for m in window])
    F.cross_entropy(ref(x), y, ignore_index=-100).backward()
    want = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
    err = float((results[0]["seen"][0] - want).norm() / want.norm())
    assert err < 1e-2, err

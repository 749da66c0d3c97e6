"""One step (and a few steps) of fullbatch equal plain full-batch PyTorch, in float64.

With SGD(lr=1) the parameter update *is* the gradient the optimizer received, so comparing
``p0 - p1`` with the reference gradient checks normalization end to end.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import fullbatch as fb
from conftest import (
    F64,
    IGNORE,
    Batch,
    assert_close_rel,
    class_batch,
    concat,
    counted,
    fb_loss,
    full_batch_reference,
    lm_batch,
    make_lm,
    make_mlp,
    params,
    ref_mean_loss,
    rel_err,
    run_fullbatch,
    sgd_update,
    split_uneven,
)

RTOL = 1e-10

# Rows of very different lengths, prompt tokens ignored, one row with a single token (no
# predicted token after the shift) and one row fully ignored.
LENGTHS = [9, 2, 5, 1, 7, 3, 6, 4, 8, 2]


def lm_window() -> Batch:
    batch = lm_batch(LENGTHS, seed=1, ignore_frac=0.2)
    batch["labels"][5] = IGNORE
    return batch


def check_one_step(model, batch: Batch, loader, rtol: float = RTOL, **acc_kwargs) -> fb.StepStats:
    ref = full_batch_reference(model, batch)
    update, stats = sgd_update(model, loader, **acc_kwargs)
    assert rel_err(update, ref.grads) < rtol
    assert not stats.skipped and stats.reason is None
    assert stats.count == ref.count
    assert_close_rel(stats.loss, ref.loss, rtol)
    assert_close_rel(stats.grad_norm, ref.grad_norm, rtol)
    assert stats.steps == 1
    return stats


# -- uneven micro-batches --------------------------------------------------------------------


@pytest.mark.parametrize("sizes", [[1, 4, 2, 3], [6, 1, 3], [3, 3, 3, 1], [10]])
def test_uneven_micro_batches_lm(sizes: list[int]) -> None:
    batch = lm_window()
    micros = split_uneven(batch, sizes)  # each micro-batch trimmed to its own width
    assert len({m["input_ids"].shape[1] for m in micros}) > 1 or len(sizes) == 1
    model = make_lm()
    stats = check_one_step(model, batch, micros, micro_batches=len(sizes))
    assert stats.micro_batches == len(sizes)


def test_uneven_micro_batches_mlp() -> None:
    batch = class_batch(11, seed=2, ignore=(0, 3, 4, 9))
    micros = split_uneven(batch, [2, 5, 1, 3])
    check_one_step(make_mlp(), batch, micros, micro_batches=4)


def test_micro_batch_with_no_counted_item_inside_a_window() -> None:
    batch = lm_window()
    micros = split_uneven(batch, [3, 3, 4])
    micros[1]["labels"][:] = IGNORE  # contributes a zero sum and zero count
    full = concat(micros)
    check_one_step(make_lm(), full, micros, micro_batches=3)


# -- every micro_batch_size ------------------------------------------------------------------


@pytest.mark.parametrize("size", range(1, len(LENGTHS) + 3))
def test_every_micro_batch_size_lm(size: int) -> None:
    batch = lm_window()
    stats = check_one_step(make_lm(), batch, [batch], micro_batch_size=size)
    assert stats.micro_batches == math.ceil(len(LENGTHS) / size)


@pytest.mark.parametrize("size", [1, 2, 4, 7, 8, 50])
def test_every_micro_batch_size_mlp(size: int) -> None:
    batch = class_batch(8, seed=3, ignore=(1, 6))
    check_one_step(make_mlp(), batch, [batch], micro_batch_size=size)


# -- several windows: partial tail, drop, unsized streams -------------------------------------


def reference_trajectory(model, windows: list[Batch], make_opt, make_sched=None):
    """The plain full-batch loop: one mean-loss backward and one step per window."""
    ref = copy.deepcopy(model)
    opt = make_opt(ref)
    sched = make_sched(opt) if make_sched else None
    out = []
    for batch in windows:
        opt.zero_grad(set_to_none=True)
        lr = opt.param_groups[0]["lr"]
        loss = ref_mean_loss(ref, batch)
        loss.backward()
        norm = math.sqrt(sum(float(p.grad.square().sum()) for p in ref.parameters()))
        opt.step()
        if sched is not None:
            sched.step()
        out.append({"loss": float(loss.detach()), "norm": norm, "lr": lr, "params": params(ref)})
    return out


def fullbatch_trajectory(model, loader, make_opt, make_sched=None, **acc_kwargs):
    opt = make_opt(model)
    sched = make_sched(opt) if make_sched else None
    snaps = []
    stats = run_fullbatch(
        model,
        opt,
        loader,
        after_step=lambda s: snaps.append(params(model)),
        scheduler=sched,
        **acc_kwargs,
    )
    return stats, snaps


def assert_same_trajectory(stats, snaps, ref, rtol: float = RTOL) -> None:
    assert len(stats) == len(ref)
    for i, (s, p, r) in enumerate(zip(stats, snaps, ref, strict=True)):
        assert not s.skipped, (i, s)
        assert s.steps == i + 1
        assert_close_rel(s.loss, r["loss"], rtol)
        assert_close_rel(s.grad_norm, r["norm"], rtol)
        assert s.lr == pytest.approx(r["lr"], rel=1e-15)
        assert rel_err(p, r["params"]) < rtol, f"window {i}"


def sgd(m):
    return torch.optim.SGD(m.parameters(), lr=0.5)


def lm_stream(n: int) -> list[Batch]:
    lengths = [3, 7, 1, 5, 2, 6, 4, 8, 2, 5, 3]
    return [
        lm_batch(
            lengths[i % len(lengths) : i % len(lengths) + 2] or [4], seed=10 + i, ignore_frac=0.1
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("n_micro,k", [(7, 3), (8, 3), (5, 2), (4, 5), (6, 3)])
def test_partial_last_window_steps_with_its_own_count(n_micro: int, k: int) -> None:
    micros = lm_stream(n_micro)
    windows = [concat(micros[i : i + k]) for i in range(0, n_micro, k)]
    model = make_lm()
    ref = reference_trajectory(model, windows, sgd)
    stats, snaps = fullbatch_trajectory(model, micros, sgd, micro_batches=k)
    assert_same_trajectory(stats, snaps, ref)
    sizes = [len(micros[i : i + k]) for i in range(0, n_micro, k)]
    assert [s.micro_batches for s in stats] == sizes
    assert stats[-1].count == counted(windows[-1])  # the tail is normalized by its own count


@pytest.mark.parametrize("n_micro,k", [(7, 3), (8, 3), (6, 3), (2, 3)])
def test_partial_window_drop(n_micro: int, k: int) -> None:
    micros = lm_stream(n_micro)
    windows = [concat(micros[i : i + k]) for i in range(0, n_micro - k + 1, k)]
    model = make_lm()
    before = params(model)
    ref = reference_trajectory(model, windows, sgd)
    stats, snaps = fullbatch_trajectory(model, micros, sgd, micro_batches=k, partial_window="drop")
    assert len(stats) == n_micro // k
    assert_same_trajectory(stats, snaps, ref)
    if not ref:  # no full window at all: nothing stepped
        assert all(torch.equal(a, b) for a, b in zip(params(model), before, strict=True))


def test_unsized_stream_of_micro_batches() -> None:
    micros = lm_stream(7)
    windows = [concat(micros[i : i + 3]) for i in range(0, 7, 3)]
    model = make_lm()
    ref = reference_trajectory(model, windows, sgd)
    stats, snaps = fullbatch_trajectory(model, (m for m in micros), sgd, micro_batches=3)
    assert_same_trajectory(stats, snaps, ref)


def test_unsized_stream_of_windows_with_micro_batch_size() -> None:
    windows = [lm_batch([4, 2, 6, 1, 3], seed=20 + i, ignore_frac=0.1) for i in range(3)]
    windows.append(lm_batch([5, 2], seed=30))
    model = make_lm()
    ref = reference_trajectory(model, windows, sgd)
    stats, snaps = fullbatch_trajectory(model, iter(windows), sgd, micro_batch_size=2)
    assert_same_trajectory(stats, snaps, ref)
    assert [s.micro_batches for s in stats] == [3, 3, 3, 1]


def test_reads_only_one_micro_batch_ahead() -> None:
    """Without counts=, drop or len(), a window holds one micro-batch of lookahead."""
    pulled: list[int] = []
    seen: list[int] = []

    def stream():
        for i in range(8):
            pulled.append(i)
            yield class_batch(2, seed=i)

    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with fb.Accumulator(model, opt, micro_batches=4) as acc:
        for window in acc.windows(stream()):
            for micro in window:
                seen.append(len(pulled))
                window.backward(*fb_loss(model, micro))
            window.step()
    # when micro-batch j of a window is handed out, at most j + 2 items have been read
    assert seen == [1 + min(j + 1, 3) + 4 * w for w in range(2) for j in range(4)], seen


def test_dataloader_of_micro_batches() -> None:
    batch = class_batch(10, seed=4, ignore=(2, 7))
    dataset = torch.utils.data.TensorDataset(batch["x"], batch["y"])
    loader = torch.utils.data.DataLoader(dataset, batch_size=3)  # sizes 3, 3, 3, 1
    model = make_mlp()
    ref = full_batch_reference(model, batch)

    def loss(m, micro):
        x, y = micro
        return fb.cross_entropy_sum(m(x), y)

    before = params(model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    (stats,) = run_fullbatch(model, opt, loader, loss=loss, micro_batches=4)
    update = [b - a for b, a in zip(before, params(model), strict=True)]
    assert rel_err(update, ref.grads) < RTOL
    assert_close_rel(stats.loss, ref.loss, RTOL)


# -- clipping --------------------------------------------------------------------------------


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("fraction", [0.3, 0.999, 5.0])
def test_clipping_equals_clipped_full_batch_gradient(fraction: float, scaled: bool) -> None:
    batch = lm_window()
    model = make_lm()
    ref = full_batch_reference(model, batch)
    max_norm = fraction * ref.grad_norm
    # Independent reference: torch's own clip_grad_norm_ on the full-batch gradient.
    clipped = [g.clone() for g in ref.grads]
    holders = [torch.nn.Parameter(torch.zeros_like(g)) for g in clipped]
    for h, g in zip(holders, clipped, strict=True):
        h.grad = g
    torch.nn.utils.clip_grad_norm_(holders, max_norm)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**14) if scaled else None
    update, stats = sgd_update(
        model, [batch], micro_batch_size=3, max_grad_norm=max_norm, scaler=scaler
    )
    assert rel_err(update, [h.grad for h in holders]) < RTOL
    assert_close_rel(stats.grad_norm, ref.grad_norm, RTOL)  # reported norm is pre-clip
    if fraction < 1:
        new_norm = math.sqrt(sum(float(u.square().sum()) for u in update))
        assert new_norm == pytest.approx(max_norm, rel=1e-5)


# -- GradScaler on CPU -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype,rtol", [(torch.float64, RTOL), (torch.float32, 1e-5)])
def test_grad_scaler_cpu(dtype: torch.dtype, rtol: float) -> None:
    batch = lm_window()
    model = make_lm(dtype=dtype)
    ref_model = make_lm(dtype=F64)  # same init, in float64
    ref = full_batch_reference(ref_model, batch)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    grads = []
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    opt.register_step_pre_hook(
        lambda o, a, k: grads.extend(p.grad.detach().clone() for p in model.parameters())
    )
    (stats,) = run_fullbatch(model, opt, [batch], micro_batch_size=3, scaler=scaler)
    assert not stats.skipped
    assert rel_err(grads, ref.grads) < rtol
    assert_close_rel(stats.loss, ref.loss, rtol)
    assert_close_rel(stats.grad_norm, ref.grad_norm, rtol)
    assert scaler.get_scale() == 2.0**10  # finite gradients: no backoff, no growth yet


def test_grad_scaler_float64_update_is_exact() -> None:
    batch = lm_window()
    model = make_lm()
    ref = full_batch_reference(model, batch)
    scaler = torch.amp.GradScaler("cpu")
    update, stats = sgd_update(model, [batch], micro_batch_size=4, scaler=scaler)
    assert rel_err(update, ref.grads) < RTOL
    assert_close_rel(stats.grad_norm, ref.grad_norm, RTOL)


# -- two loss terms with different denominators ----------------------------------------------

AUX_WEIGHT = 0.3


def aux_row_sum(logits: torch.Tensor) -> torch.Tensor:
    """A per-row term (one item per row): the mean squared logit of the row's first position."""
    return logits[:, 0].square().mean(dim=-1).sum()


def two_term_objective(weight: float = AUX_WEIGHT):
    """Plain PyTorch: mean token cross-entropy plus ``weight`` x the mean per-row term."""

    def objective(m, b):
        logits = m(b["input_ids"])
        ce = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]),
            b["labels"][:, 1:].reshape(-1),
            ignore_index=IGNORE,
        )
        rows = b["input_ids"].shape[0]
        return ce + weight * logits[:, 0].square().mean(dim=-1).sum() / rows

    return objective


def two_term_reference(model, batch: Batch):
    return full_batch_reference(model, batch, two_term_objective())


@pytest.mark.parametrize("loader_kind", ["micro_batches", "micro_batch_size"])
def test_two_terms_up_front_shares(loader_kind: str) -> None:
    batch = lm_window()
    model = make_lm()
    ref = two_term_reference(model, batch)
    if loader_kind == "micro_batches":
        loader, kwargs = split_uneven(batch, [4, 1, 5]), {"micro_batches": 3}
    else:
        loader, kwargs = [batch], {"micro_batch_size": 3}
    counts = {
        "tokens": lambda m: fb.count_tokens(m["labels"]),
        "rows": lambda m: m["input_ids"].shape[0],
    }
    before = params(model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    seen_totals = []
    with fb.Accumulator(model, opt, counts=counts, **kwargs) as acc:
        for window in acc.windows(loader):
            totals = window.totals  # known before the first backward
            seen_totals.append(totals)
            for micro in window:
                logits = model(micro["input_ids"])
                ce_sum, _ = fb.causal_lm_loss(logits, micro["labels"])
                window.backward(ce_sum / totals["tokens"], retain_graph=True)
                window.backward(AUX_WEIGHT * aux_row_sum(logits) / totals["rows"])
            stats = window.step()
    assert seen_totals == [{"tokens": ref.count, "rows": len(LENGTHS)}]
    update = [b - a for b, a in zip(before, params(model), strict=True)]
    assert rel_err(update, ref.grads) < RTOL
    assert_close_rel(stats.loss, ref.loss, RTOL)  # the sum of the shares
    assert_close_rel(stats.grad_norm, ref.grad_norm, RTOL)
    assert stats.totals == seen_totals[0]


def test_two_terms_count_form_second_term_count_zero() -> None:
    batch = lm_window()
    model = make_lm()

    def z_sum(logits, labels):  # z-loss over the same predicted tokens
        keep = labels[:, 1:] != IGNORE
        return (torch.logsumexp(logits[:, :-1], dim=-1) ** 2)[keep].sum()

    def objective(m, b):
        logits = m(b["input_ids"])
        ce = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]),
            b["labels"][:, 1:].reshape(-1),
            ignore_index=IGNORE,
            reduction="sum",
        )
        n = (b["labels"][:, 1:] != IGNORE).sum()
        return (ce + 1e-2 * z_sum(logits, b["labels"])) / n

    ref = full_batch_reference(model, batch, objective)
    before = params(model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with fb.Accumulator(model, opt, micro_batches=4) as acc:
        for window in acc.windows(split_uneven(batch, [2, 3, 4, 1])):
            for micro in window:
                logits = model(micro["input_ids"])
                ce_sum, n = fb.causal_lm_loss(logits, micro["labels"])
                window.backward(ce_sum, n, retain_graph=True)
                window.backward(1e-2 * z_sum(logits, micro["labels"]), 0)
            stats = window.step()
    update = [b - a for b, a in zip(before, params(model), strict=True)]
    assert rel_err(update, ref.grads) < RTOL
    assert stats.count == ref.count
    assert_close_rel(stats.loss, ref.loss, RTOL)
    assert_close_rel(stats.grad_norm, ref.grad_norm, RTOL)


def test_real_valued_weights_as_counts() -> None:
    """Counts need not be integers: a weighted mean Σ w·ℓ / Σ w."""
    batch = class_batch(9, seed=5)
    weights = torch.rand(9, dtype=F64, generator=torch.Generator().manual_seed(6)) + 0.1
    batch["w"] = weights
    model = make_mlp()

    def objective(m, b):
        per = F.cross_entropy(m(b["x"]), b["y"], reduction="none")
        return (per * b["w"]).sum() / b["w"].sum()

    ref = full_batch_reference(model, batch, objective)

    def loss(m, micro):
        per = F.cross_entropy(m(micro["x"]), micro["y"], reduction="none")
        return (per * micro["w"]).sum(), micro["w"].sum()

    before = params(model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    (stats,) = run_fullbatch(model, opt, [batch], loss=loss, micro_batch_size=2)
    update = [b - a for b, a in zip(before, params(model), strict=True)]
    assert rel_err(update, ref.grads) < RTOL
    assert_close_rel(stats.loss, ref.loss, RTOL)
    assert_close_rel(stats.count, float(weights.sum()), RTOL)


# -- several steps: AdamW + scheduler against the full-batch loop ------------------------------


def adamw(m):
    return torch.optim.AdamW(m.parameters(), lr=0.05, weight_decay=0.1)


def warmup_decay(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3) * 0.8**s)


def test_multi_step_adamw_scheduler_micro_batches() -> None:
    micros = lm_stream(14)
    k = 4  # windows of 4, 4, 4, 2 micro-batches
    windows = [concat(micros[i : i + k]) for i in range(0, 14, k)]
    model = make_lm()
    ref = reference_trajectory(model, windows, adamw, warmup_decay)
    stats, snaps = fullbatch_trajectory(model, micros, adamw, warmup_decay, micro_batches=k)
    assert_same_trajectory(stats, snaps, ref)
    assert len({s.lr for s in stats}) == len(stats)  # the schedule really moved


def test_multi_step_adamw_scheduler_clipping_micro_batch_size() -> None:
    windows = [lm_batch([5, 1, 7, 3, 2, 6], seed=40 + i, ignore_frac=0.15) for i in range(4)]
    model = make_lm()

    def clipped_ref():
        ref_model = copy.deepcopy(model)
        opt = adamw(ref_model)
        sched = warmup_decay(opt)
        out = []
        for batch in windows:
            opt.zero_grad(set_to_none=True)
            lr = opt.param_groups[0]["lr"]
            loss = ref_mean_loss(ref_model, batch)
            loss.backward()
            norm = float(torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.5))
            opt.step()
            sched.step()
            out.append(
                {"loss": float(loss.detach()), "norm": norm, "lr": lr, "params": params(ref_model)}
            )
        return out

    ref = clipped_ref()
    assert all(r["norm"] > 0.5 for r in ref), "clipping should be active in this test"
    stats, snaps = fullbatch_trajectory(
        model, windows, adamw, warmup_decay, micro_batch_size=4, max_grad_norm=0.5
    )
    assert_same_trajectory(stats, snaps, ref)


def test_mlp_multi_step_sgd_momentum_many_sizes() -> None:
    windows = [class_batch(7, seed=50 + i, ignore=(i % 7,)) for i in range(5)]

    def make_opt(m):
        return torch.optim.SGD(m.parameters(), lr=0.3, momentum=0.9, nesterov=True)

    model = make_mlp()
    ref = reference_trajectory(model, windows, make_opt)
    for size in (1, 3, 7):
        m = copy.deepcopy(model)
        stats, snaps = fullbatch_trajectory(m, windows, make_opt, micro_batch_size=size)
        assert_same_trajectory(stats, snaps, ref)


def test_loss_function_used_by_tests_matches_reference() -> None:
    """Sanity of the harness: fb_loss sums and counts what ref_mean_loss averages."""
    batch = lm_window()
    model = make_lm()
    loss_sum, n = fb_loss(model, batch)
    assert int(n) == counted(batch)
    assert_close_rel(
        float(loss_sum.detach() / n), float(ref_mean_loss(model, batch).detach()), 1e-13
    )


# -- float32: DESIGN's 1e-6 ------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 11])
def test_float32_one_step_within_1e6_of_float64_full_batch(size: int) -> None:
    batch = lm_window()
    ref = full_batch_reference(make_lm(dim=32), batch)  # float64, same initial values
    model = make_lm(dtype=torch.float32, dim=32)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    seen = []
    opt.register_step_pre_hook(
        lambda o, a, k: seen.append([p.grad.clone() for p in model.parameters()])
    )
    (stats,) = run_fullbatch(model, opt, [batch], micro_batch_size=size)
    assert rel_err(seen[0], ref.grads) < 1e-6
    assert_close_rel(stats.loss, ref.loss, 1e-6)
    assert_close_rel(stats.grad_norm, ref.grad_norm, 1e-6)


# -- share form with clipping and a GradScaler ----------------------------------------------


@pytest.mark.parametrize("scaled", [False, True])
def test_shares_with_clipping_and_scaler(scaled: bool) -> None:
    batch = lm_window()
    model = make_lm()
    ref = two_term_reference(model, batch)
    max_norm = 0.5 * ref.grad_norm
    holders = [torch.nn.Parameter(torch.zeros_like(g)) for g in ref.grads]
    for h, g in zip(holders, ref.grads, strict=True):
        h.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(holders, max_norm)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12) if scaled else None
    counts = {
        "tokens": lambda m: fb.count_tokens(m["labels"]),
        "rows": lambda m: m["input_ids"].shape[0],
    }
    before = params(model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    kwargs = {"counts": counts, "max_grad_norm": max_norm, "scaler": scaler}
    with fb.Accumulator(model, opt, micro_batch_size=3, **kwargs) as acc:
        for window in acc.windows([batch]):
            totals = window.totals
            for micro in window:
                logits = model(micro["input_ids"])
                ce_sum, _ = fb.causal_lm_loss(logits, micro["labels"])
                window.backward(ce_sum / totals["tokens"], retain_graph=True)
                window.backward(AUX_WEIGHT * aux_row_sum(logits) / totals["rows"])
            stats = window.step()
    update = [b - a for b, a in zip(before, params(model), strict=True)]
    assert rel_err(update, [h.grad for h in holders]) < RTOL
    assert_close_rel(stats.grad_norm, ref.grad_norm, RTOL)
    assert_close_rel(stats.loss, ref.loss, RTOL)
    assert stats.loss_scale == 1.0 and math.isnan(stats.count)


# -- parameters the optimizer steps but the model does not own --------------------------------


def test_optimizer_parameter_outside_the_model() -> None:
    batch = class_batch(8, seed=1, ignore=(2,))
    model = make_mlp()
    temperature = torch.nn.Parameter(torch.tensor(1.5, dtype=F64))

    def objective(m, b, t):
        return F.cross_entropy(m(b["x"]) * t, b["y"], ignore_index=IGNORE)

    ref_model = copy.deepcopy(model)
    ref_t = torch.nn.Parameter(temperature.detach().clone())
    objective(ref_model, batch, ref_t).backward()
    want = [*(p.grad for p in ref_model.parameters()), ref_t.grad]

    opt = torch.optim.SGD([*model.parameters(), temperature], lr=1.0)
    try:
        acc = fb.Accumulator(model, opt, micro_batch_size=3)
    except ValueError:
        return  # refusing loudly is a fix too
    before = [*params(model), temperature.detach().clone()]
    with acc:
        for window in acc.windows([batch]):
            for micro in window:
                loss_sum, n = fb.cross_entropy_sum(model(micro["x"]) * temperature, micro["y"])
                window.backward(loss_sum, n)
            window.step()
    after = [*params(model), temperature.detach().clone()]
    update = [b - a for b, a in zip(before, after, strict=True)]
    assert rel_err(update[-1:], want[-1:]) < RTOL
    assert rel_err(update, want) < RTOL


@pytest.mark.parametrize("kwargs", [{"micro_batches": 2}, {"micro_batch_size": 2}])
def test_empty_loader_yields_no_window(kwargs) -> None:
    model = make_mlp()
    before = params(model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    assert run_fullbatch(model, opt, iter([]), **kwargs) == []
    assert all(torch.equal(a, b) for a, b in zip(before, params(model), strict=True))

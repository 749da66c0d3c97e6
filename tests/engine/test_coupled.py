"""``window.run_coupled(encode, loss)``: contrastive losses accumulated exactly.

Every test compares against plain PyTorch in float64: one forward of the whole batch, mean
InfoNCE with in-batch negatives, one backward. The naive loop (InfoNCE per micro-batch, so
fewer negatives) is shown to differ.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import _coupled_cases as cases
import fullbatch as fb
from _coupled_cases import TEMPERATURE, encoder, info_nce, make_model, pairs, reference_grads, rel
from _dist import run_ranks, values

ROWS = 20


def _coupled_grads(model: nn.Module, batch: dict, size: int, **kwargs) -> tuple[list, fb.StepStats]:
    """The normalized window gradient (captured by a window hook) and the window's stats."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads: list[list[torch.Tensor]] = []
    with fb.Accumulator(model, opt, micro_batch_size=size, **kwargs) as acc:
        acc.register_window_hook(
            lambda: grads.append([p.grad.detach().clone() for p in model.parameters()])
        )
        window = next(iter(acc.windows([batch])))
        stats = window.run_coupled(encoder(model), info_nce)
    return grads[0], stats


@pytest.mark.parametrize("size", [1, 3, 8])
def test_gradient_and_loss_equal_the_full_batch(size: int) -> None:
    model, batch = make_model(), pairs(ROWS)
    want = reference_grads(model, batch)
    with torch.no_grad():
        q, d = model(batch["q"], batch["d"])
        want_loss = float(F.cross_entropy(q @ d.T / TEMPERATURE, torch.arange(ROWS)))
    got, stats = _coupled_grads(model, batch, size)
    assert rel(got, want) < 1e-10
    assert stats.count == ROWS and not stats.skipped
    assert abs(stats.loss - want_loss) <= 1e-12 * want_loss


@pytest.mark.parametrize("size", [3, 8])
def test_naive_per_micro_batch_loss_differs(size: int) -> None:
    model, batch = make_model(), pairs(ROWS)
    want = reference_grads(model, batch)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads: list[list[torch.Tensor]] = []
    with fb.Accumulator(model, opt, micro_batch_size=size) as acc:
        acc.register_window_hook(lambda: grads.append([p.grad.clone() for p in model.parameters()]))
        for window in acc.windows([batch]):
            # InfoNCE inside each micro-batch: fewer negatives, a different objective.
            window.run(lambda m: info_nce(model(m["q"], m["d"]), slice(None)))
    assert rel(grads[0], want) > 1e-2


def test_training_with_clipping_follows_the_full_batch() -> None:
    """Three SGD-with-momentum steps with clipping: parameters equal the full-batch run's."""
    model = make_model()
    ref = copy.deepcopy(model)
    windows = [pairs(ROWS, seed) for seed in range(3)]
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for batch in windows:
        q, d = ref(batch["q"], batch["d"])
        F.cross_entropy(q @ d.T / TEMPERATURE, torch.arange(ROWS)).backward()
        nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with fb.Accumulator(model, opt, micro_batch_size=6, max_grad_norm=0.5) as acc:
        steps = [w.run_coupled(encoder(model), info_nce).steps for w in acc.windows(windows)]
    assert steps == [1, 2, 3]
    assert rel(list(model.parameters()), list(ref.parameters())) < 1e-10


def test_dropout_masks_are_replayed() -> None:
    """With dropout, the gradient equals the full batch evaluated with pass 1's masks.

    Pass 1 draws micro-batch k's masks from the RNG state it finds; the reference draws the
    same masks by encoding the micro-batches in order from the same starting state, and then
    computes the loss of the whole batch on the concatenation (one graph, one backward).
    """
    model, batch, size = make_model(dropout=0.3), pairs(ROWS), 6
    ref = copy.deepcopy(model)
    torch.manual_seed(123)
    parts = [ref(batch["q"][i : i + size], batch["d"][i : i + size]) for i in range(0, ROWS, size)]
    q = torch.cat([p[0] for p in parts])
    d = torch.cat([p[1] for p in parts])
    F.cross_entropy(q @ d.T / TEMPERATURE, torch.arange(ROWS)).backward()
    want = [p.grad for p in ref.parameters()]
    assert all(g is not None for g in want)
    after_reference = torch.get_rng_state()

    torch.manual_seed(123)
    got, _ = _coupled_grads(model, batch, size)
    assert rel(got, want) < 1e-10  # type: ignore[arg-type]
    # The RNG stream continues as after one pass: pass 2 consumed nothing new.
    assert torch.equal(torch.get_rng_state(), after_reference)
    # Without the replay the masks would differ: a second draw gives other representations.
    with torch.no_grad():
        torch.manual_seed(123)
        first = model.q(batch["q"][:size])
        second = model.q(batch["q"][:size])
    assert not torch.equal(first, second)


def test_first_micro_batch_is_encoded_once() -> None:
    """Pass 1 keeps micro-batch 0's graph: K micro-batches cost 2K - 1 encodes, not 2K."""
    model, calls = make_model(dropout=0.3), []

    def encode(micro: dict) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append((micro["q"][0, 0].item(), torch.is_grad_enabled()))
        return model(micro["q"], micro["d"])

    _one_window(model).run_coupled(encode, info_nce)
    first, second = pairs(8)["q"][0, 0].item(), pairs(8)["q"][4, 0].item()
    assert calls == [(first, True), (second, False), (second, True)]


def test_single_tensor_representations() -> None:
    """``encode`` may return one tensor; ``loss`` then gets one tensor."""
    model, batch = make_model(), pairs(ROWS)
    want = reference_grads(model, batch)

    def one_tower(reps: torch.Tensor, rows: slice) -> tuple[torch.Tensor, int]:
        assert isinstance(reps, torch.Tensor)
        return info_nce((reps[:, : cases.EMB], reps[:, cases.EMB :]), rows)

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads: list[list[torch.Tensor]] = []
    with fb.Accumulator(model, opt, micro_batch_size=3) as acc:
        acc.register_window_hook(lambda: grads.append([p.grad.clone() for p in model.parameters()]))
        window = next(iter(acc.windows([batch])))
        window.run_coupled(lambda m: torch.cat(model(m["q"], m["d"]), dim=1), one_tower)
    assert rel(grads[0], want) < 1e-10


def test_micro_batches_from_the_loader() -> None:
    """``micro_batches=K``: the loader's micro-batches (uneven sizes) make the window."""
    model, batch = make_model(), pairs(ROWS)
    want = reference_grads(model, batch)
    cuts = [0, 2, 9, 10, ROWS]
    micros = [{k: v[a:b] for k, v in batch.items()} for a, b in itertools.pairwise(cuts)]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads: list[list[torch.Tensor]] = []
    with fb.Accumulator(model, opt, micro_batches=4) as acc:
        acc.register_window_hook(lambda: grads.append([p.grad.clone() for p in model.parameters()]))
        window = next(iter(acc.windows(micros)))
        window.run_coupled(encoder(model), info_nce)
    assert rel(grads[0], want) < 1e-10


def test_grad_scaler_gives_the_same_gradient() -> None:
    """A GradScaler's scale seeds pass 2's backward and is undone at the step, as everywhere."""
    model, batch = make_model(), pairs(ROWS)
    want = reference_grads(model, batch)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    got, stats = _coupled_grads(model, batch, 3, scaler=scaler)
    assert rel(got, want) < 1e-10 and not stats.skipped


@pytest.mark.filterwarnings("ignore:window 0 was skipped")
def test_non_finite_loss_skips_the_step() -> None:
    model, batch = make_model(), pairs(ROWS)
    before = [p.detach().clone() for p in model.parameters()]

    def broken(reps, rows):
        loss_sum, n = info_nce(reps, rows)
        return loss_sum * float("inf"), n

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with fb.Accumulator(model, opt, micro_batch_size=4) as acc:
        windows = acc.windows([batch, batch])
        skipped = next(windows).run_coupled(encoder(model), broken)
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
        stepped = next(windows).run_coupled(encoder(model), info_nce)
    assert skipped.skipped and skipped.steps == 0
    assert not stepped.skipped and stepped.steps == 1


@pytest.mark.parametrize("options", [{"micro_batch_size": 4}, {"micro_batch_tokens": 12}])
def test_rows_sorted_by_length_stay_exact(options: dict) -> None:
    """Sorting rows (sort_rows, token budgets) reorders the window: InfoNCE does not care."""
    model, batch = make_model(), pairs(ROWS)
    want = reference_grads(model, batch)
    g = torch.Generator().manual_seed(5)
    batch["mask"] = (torch.arange(6) < torch.randint(1, 7, (ROWS, 1), generator=g)).long()
    if "micro_batch_size" in options:
        options = {**options, "sort_rows": True}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads: list[list[torch.Tensor]] = []
    with fb.Accumulator(model, opt, lengths="mask", **options) as acc:
        acc.register_window_hook(lambda: grads.append([p.grad.clone() for p in model.parameters()]))
        window = next(iter(acc.windows([batch])))
        stats = window.run_coupled(encoder(model), info_nce)
    assert stats.micro_batches > 1
    assert rel(grads[0], want) < 1e-10


# -- "auto": an out-of-memory error in either pass re-runs the whole window at half the size --


def _size(micro: dict) -> tuple[int, str]:
    """Rows, or padded tokens when the micro-batch has a mask."""
    if "mask" in micro:
        lengths = micro["mask"].sum(1)
        return len(lengths) * int(lengths.max()), "tokens"
    return micro["q"].shape[0], "rows"


def _fitting(
    model: nn.Module, fits: int, when: str = "always", once_after_loss: bool = False
) -> tuple[Any, list[int], Any]:
    """``encode`` raising ``torch.OutOfMemoryError`` above ``fits`` rows or padded tokens:
    in every forward ("always") or in forwards that build a graph ("graph": pass 2, and
    micro-batch 0 in pass 1, whose graph pass 2 reuses); with ``once_after_loss``, also in the
    first pass-2 forward of the run. Returns ``(encode, calls, loss)``: use that loss."""
    calls: list[int] = []
    phase = {"after_loss": False, "failed_after_loss": False}

    def encode(micro: dict) -> tuple[torch.Tensor, torch.Tensor]:
        n, unit = _size(micro)
        calls.append(n)
        graph = torch.is_grad_enabled()
        if once_after_loss and phase["after_loss"] and not phase["failed_after_loss"]:
            phase["failed_after_loss"], phase["after_loss"] = True, False
            raise torch.OutOfMemoryError(f"{n} {unit} do not fit (once, in pass 2)")
        if n > fits and (when == "always" or (when == "graph" and graph)):
            phase["after_loss"] = False
            raise torch.OutOfMemoryError(f"{n} {unit} do not fit (threshold {fits})")
        return model(micro["q"], micro["d"])

    def loss(reps: Any, rows: slice) -> tuple[torch.Tensor, int]:
        out = info_nce(reps, rows)
        phase["after_loss"] = True
        return out

    return encode, calls, loss


def _train_coupled(model: nn.Module, data: list[dict], fits: int, when: str, **options):
    """AdamW on run_coupled: per window (stats, parameters, the size it ran with)."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    encode, _, loss = _fitting(model, fits, when)
    kind = "micro_batch_tokens" if "micro_batch_tokens" in options else "micro_batch_size"
    out = []
    torch.manual_seed(123)
    with fb.Accumulator(model, opt, **options) as acc:
        for window in acc.windows(data):
            stats = window.run_coupled(encode, loss)
            out.append((stats, [p.detach().clone() for p in model.parameters()]))
            out[-1] += (getattr(acc, kind),)
            assert all(p.grad is None for p in model.parameters())
    return out


@pytest.mark.parametrize("when", ["always", "graph"])
@pytest.mark.parametrize(("fits", "found", "retries"), [(3, 2, 3), (5, 5, 2), (20, 20, 0)])
def test_auto_equals_the_found_size_from_the_start(when, fits, found, retries) -> None:
    """Bitwise (CPU, float64, dropout): RNG restored, both passes re-run from the start."""
    model = make_model(dropout=0.3)
    ref = copy.deepcopy(model)
    data = [pairs(n, seed) for seed, n in enumerate((ROWS, ROWS, 13))]
    got = _train_coupled(model, data, fits, when, micro_batch_size="auto")
    rng_got = torch.get_rng_state()
    want = _train_coupled(ref, data, 10**9, when, micro_batch_size=found)
    assert torch.equal(rng_got, torch.get_rng_state())  # the RNG stream continues alike
    assert [s.retries for s, *_ in got] == [retries, 0, 0]
    assert [size for *_, size in got] == [found, found, min(found, 13)]
    for (gs, gp, _), (ws, wp, _) in zip(got, want, strict=True):
        assert gs == dataclasses.replace(ws, retries=gs.retries)
        assert all(torch.equal(a, b) for a, b in zip(gp, wp, strict=True))


def test_auto_reruns_both_passes_from_the_window_start() -> None:
    """An OOM in pass 2 abandons the attempt: the re-run starts again with pass 1."""
    model = make_model()
    encode, calls, loss = _fitting(model, 10, "always", once_after_loss=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with fb.Accumulator(model, opt, micro_batch_size="auto") as acc:
        stats = next(iter(acc.windows([pairs(ROWS)]))).run_coupled(encode, loss)
    # 20 rows: pass 1 fails; 10: pass 1 (2 micro-batches), then pass 2 fails on micro-batch 1
    # (micro-batch 0 keeps its pass-1 graph); 5: pass 1 (4) and pass 2 (micro-batches 1-3).
    assert calls == [20, 10, 10, 10] + [5] * 7
    assert stats.retries == 2 and stats.micro_batches == 4 and acc.micro_batch_size == 5


def test_auto_token_budget_equals_the_found_budget() -> None:
    model = make_model(dropout=0.3)
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(5)
    data = [pairs(ROWS, seed) for seed in range(2)]
    for batch in data:
        batch["mask"] = (torch.arange(6) < torch.randint(1, 7, (ROWS, 1), generator=g)).long()
    got = _train_coupled(model, data, 24, "always", micro_batch_tokens="auto", lengths="mask")
    budget = got[0][2]
    assert got[0][0].retries > 0 and budget is not None and budget <= 24 < 2 * budget
    want = _train_coupled(ref, data, 10**9, "always", micro_batch_tokens=budget, lengths="mask")
    for (gs, gp, _), (ws, wp, _) in zip(got, want, strict=True):
        # c (a power of two, so exact either way) is estimated from the first attempt's
        # micro-batches, whose padding differs from the found budget's.
        assert gs == dataclasses.replace(ws, retries=gs.retries, loss_scale=gs.loss_scale)
        assert all(torch.equal(a, b) for a, b in zip(gp, wp, strict=True))


@pytest.mark.parametrize("when", ["always", "graph"])
def test_auto_oom_at_one_row_reraises(when: str) -> None:
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    encode, _, _ = _fitting(model, 0, when)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with fb.Accumulator(model, opt, micro_batch_size="auto") as acc:
        window = next(iter(acc.windows([pairs(4)])))
        with pytest.raises(torch.OutOfMemoryError, match="1 rows do not fit"):
            window.run_coupled(encode, info_nce)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))


# -- errors ------------------------------------------------------------------------------------


def _one_window(model: nn.Module) -> fb.Window:
    acc = fb.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=4)
    window = next(iter(acc.windows([pairs(8)])))
    return window


@pytest.mark.parametrize(
    ("encode", "message"),
    [
        (lambda m: {"q": m["q"]}, "encode returned dict"),
        (lambda m: (m["q"], m["d"][:2]), "shapes"),
        (lambda m: m["q"].sum(), "shapes"),
        (lambda m: (m["q"] > 0).long(), "dtypes"),
    ],
)
def test_bad_encode_output_raises(encode, message: str) -> None:
    window = _one_window(make_model())
    with pytest.raises(ValueError, match=message):
        window.run_coupled(encode, info_nce)


@pytest.mark.parametrize(
    ("loss", "message"),
    [
        (lambda reps, rows: reps[0].sum(), "return \\(loss_sum, count\\)"),
        (lambda reps, rows: (reps[0][rows], 3), "return \\(loss_sum, count\\)"),
        (lambda reps, rows: (reps[0].detach().sum(), 3), "does not require grad"),
    ],
)
def test_bad_loss_output_raises(loss, message: str) -> None:
    model = make_model()
    window = _one_window(model)
    with pytest.raises(ValueError, match=message):
        window.run_coupled(encoder(model), loss)
    assert all(p.grad is None for p in model.parameters())


def test_after_iterating_raises() -> None:
    model = make_model()
    window = _one_window(model)
    iter(window)
    with pytest.raises(RuntimeError, match="already iterated"):
        window.run_coupled(encoder(model), info_nce)


def test_encode_with_different_shapes_in_pass_two_raises() -> None:
    model = make_model()
    calls = [0]

    def flaky(micro: dict) -> tuple[torch.Tensor, torch.Tensor]:
        calls[0] += 1
        q, d = model(micro["q"], micro["d"])
        return (q, d) if calls[0] <= 2 else (q[:1], d[:1])

    with pytest.raises(RuntimeError, match="different shapes"):
        _one_window(model).run_coupled(flaky, info_nce)


# -- DDP on 2 gloo ranks -----------------------------------------------------------------------


@pytest.mark.parametrize("options", [{"static_graph": True}, {"find_unused_parameters": True}])
def test_ddp_options_keep_the_full_batch(options: dict) -> None:
    """static_graph (its first window encodes micro-batch 0 twice, later ones keep its graph)
    and find_unused_parameters: every window equals the full batch on both ranks."""
    layout, windows = [7, 5], 3
    ranks = values(run_ranks(cases.ddp_coupled, 2, layout, 3, windows, options))
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for w in range(windows):
        want = reference_grads(model, pairs(sum(layout), w))
        for r in ranks:
            assert rel(r["grads"][w], want) < 1e-10, (w, rel(r["grads"][w], want))
        for p, g in zip(model.parameters(), want, strict=True):
            p.grad = g
        opt.step()
        opt.zero_grad(set_to_none=True)
    if "find_unused_parameters" in options:
        assert all(r["syncs"] == windows * r["buckets"] for r in ranks)


@pytest.mark.parametrize(("layout", "size"), [([7, 5], 3), ([4, 9], 1), ([8, 8], 8)])
def test_ddp_equals_the_full_batch_with_one_sync_per_window(layout: list[int], size: int) -> None:
    windows = 2
    ranks = values(run_ranks(cases.ddp_coupled, 2, layout, size, windows))
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rows = sum(layout)
    for w in range(windows):
        batch = pairs(rows, w)
        want = reference_grads(model, batch)
        with torch.no_grad():
            q, d = model(batch["q"], batch["d"])
            want_loss = float(F.cross_entropy(q @ d.T / TEMPERATURE, torch.arange(rows)))
        for r in ranks:
            assert rel(r["grads"][w], want) < 1e-10, (w, rel(r["grads"][w], want))
            assert abs(r["losses"][w] - want_loss) <= 1e-12 * want_loss
        for p, g in zip(model.parameters(), want, strict=True):
            p.grad = g
        opt.step()
        opt.zero_grad(set_to_none=True)
    for r in ranks:
        assert r["buckets"] > 1  # several buckets: the count below is per window, not per call
        assert r["syncs"] == windows * r["buckets"]


@pytest.mark.parametrize(("layout", "size"), [([7, 5], 3), ([4, 9], 2)])
def test_fsdp2_equals_the_full_batch(layout: list[int], size: int) -> None:
    windows = 2
    ranks = values(run_ranks(cases.fsdp_coupled, 2, layout, size, windows))
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for w in range(windows):
        want = reference_grads(model, pairs(sum(layout), w))
        for r in ranks:
            assert rel(r["grads"][w], want) < 1e-10, (w, rel(r["grads"][w], want))
        for p, g in zip(model.parameters(), want, strict=True):
            p.grad = g
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp"])
@pytest.mark.parametrize("when", ["always", "graph", "loss"])
def test_auto_when_one_rank_runs_out_of_memory(wrapper: str, when: str) -> None:
    """Rank 1 (5 rows) fails above 3 rows: 5 -> 2 on both ranks (7 rows -> 2 as well).

    "loss": rank 1's first loss call fails (between the gathers and the all-reduce): 5 -> 2.
    """
    spec = {"wrapper": wrapper, "when": when, "fits": 3, "layout": [7, 5], "windows": 2}
    ranks = values(run_ranks(cases.auto_coupled, 2, spec, pg_timeout=20))
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for w in range(2):
        want = reference_grads(model, pairs(12, w))
        for r in ranks:
            assert rel(r["grads"][w], want) < 1e-10, (w, rel(r["grads"][w], want))
        for p, g in zip(model.parameters(), want, strict=True):
            p.grad = g
        opt.step()
        opt.zero_grad(set_to_none=True)
    for r in ranks:
        assert r["retries"] == [1, 0] and r["sizes"] == [2, 2]


@pytest.mark.timeout(180)
def test_auto_ddp_oom_at_one_row_reraises_on_that_rank() -> None:
    spec = {"wrapper": "ddp", "when": "always", "fits": 0, "layout": [7, 5], "windows": 1}
    ranks = run_ranks(cases.auto_coupled, 2, spec, pg_timeout=20)
    assert [r.error_type for r in ranks] == ["RuntimeError", "OutOfMemoryError"]

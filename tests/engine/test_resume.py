"""Resume: a run saved mid-window (or at a boundary), killed and resumed in fresh objects is
bitwise the uninterrupted run on CPU (float32, dropout, AdamW, a scheduler); bad states are
refused with nothing changed."""

from __future__ import annotations

import io
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import fullbatch as fb

IN, OUT = 6, 5
K = 4  # micro-batches per window (micro_batches mode)
ROWS = 3  # rows per micro-batch (micro_batch_size mode)


def make_model(seed: int = 0, hidden: int = 16, batchnorm: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    norm: nn.Module = nn.BatchNorm1d(hidden) if batchnorm else nn.Identity()
    return nn.Sequential(
        nn.Linear(IN, hidden), norm, nn.Dropout(0.3), nn.Tanh(), nn.Linear(hidden, OUT)
    )


def batch(index: int, rows: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + index)
    y = torch.randint(0, OUT, (rows,), generator=g)
    y[torch.rand(rows, generator=g) < 0.25] = -100
    return {"x": torch.randn(rows, IN, generator=g), "y": y}


# micro_batches=K: 3 windows of K micro-batches and a partial one; micro_batch_size=ROWS:
# windows of 7 to 11 rows, split into 3 or 4 micro-batches.
LOADERS = {
    "micro_batches": [batch(i, 2 + i % 3) for i in range(3 * K + 2)],
    "micro_batch_size": [batch(i, 7 + 2 * i % 5) for i in range(4)],
}


def options(mode: str) -> dict[str, Any]:
    return {"micro_batches": K} if mode == "micro_batches" else {"micro_batch_size": ROWS}


def build(mode: str, seed: int = 0, **acc_options: Any) -> tuple[Any, ...]:
    model = make_model(seed, batchnorm=acc_options.get("batchnorm") == "window")
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    acc = fb.Accumulator(model, opt, scheduler=sched, **options(mode), **acc_options)
    return model, opt, sched, acc


def save(*objs: Any) -> list[Any]:
    """States through torch.save / torch.load(weights_only=True), as a checkpoint would go."""
    buf = io.BytesIO()
    torch.save([o.state_dict() for o in objs], buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def train(
    objs: tuple[Any, ...], loader: list[Any], stop: tuple[int, int | None] | None = None
) -> list[Any] | None:
    """Train to the end; or stop at ``(window, done)`` and return the saved states.

    ``done`` is the number of micro-batches done in that window (after their backward), or
    None for after its step.
    """
    model, _, _, acc = objs
    for w, window in enumerate(acc.windows(loader)):
        if stop == (w, 0):
            return save(*objs)
        for j, micro in enumerate(window):
            loss_sum, n = fb.cross_entropy_sum(model(micro["x"]), micro["y"])
            # up-front normalization: shares of window.totals
            if acc._engine.micro_plan.counts is not None:
                window.backward(loss_sum / window.totals["items"])
            else:
                window.backward(loss_sum, n)
            if stop == (w, j + 1):
                return save(*objs)
        window.step()
        if stop == (w, None):
            return save(*objs)
    return None


def uninterrupted(mode: str, **acc_options: Any) -> tuple[nn.Module, fb.Accumulator]:
    objs = build(mode, **acc_options)
    torch.manual_seed(123)
    train(objs, LOADERS[mode])
    return objs[0], objs[3]


def resumed(mode: str, stop: tuple[int, int | None], **acc_options: Any) -> tuple[Any, ...]:
    objs = build(mode, **acc_options)
    torch.manual_seed(123)
    states = train(objs, LOADERS[mode], stop)
    assert states is not None
    objs[3].close()
    # "Killed": fresh objects from another initialization (which also moves the RNG).
    fresh = build(mode, seed=7, **acc_options)
    for obj, state in zip(fresh, states, strict=True):
        obj.load_state_dict(state)
    acc_state = states[3]
    assert train(fresh, LOADERS[mode][acc_state["loader_items"] :]) is None
    return fresh


def assert_bitwise(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(p, q), f"{name} differs"


STOPS = [
    (1, None),  # window boundary, after a step
    (2, 0),  # window boundary, a window handed out but not iterated
    (1, 1),  # after the first micro-batch
    (1, 2),  # in the middle
    (2, 3),  # before the last micro-batch (window 2 has 4 in both modes)
    (2, 4),  # after the last backward, before the step
    (0, 1),  # inside the first window (c from the estimate)
]


@pytest.mark.parametrize("mode", ["micro_batches", "micro_batch_size"])
@pytest.mark.parametrize("stop", STOPS)
def test_resume_is_bitwise(mode: str, stop: tuple[int, int | None]) -> None:
    model, acc = uninterrupted(mode)
    fresh = resumed(mode, stop)
    assert_bitwise(model, fresh[0])
    assert fresh[3].steps == acc.steps
    assert fresh[2].last_epoch == acc._engine.step_plan.scheduler.last_epoch


def test_resume_matches_the_full_batch_reference() -> None:
    """float64, SGD: the resumed run's steps are the plain full-batch steps."""
    loader = LOADERS["micro_batches"]

    def model64() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(IN, 16), nn.Tanh(), nn.Linear(16, OUT)).double()

    ref = model64()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for w in range(0, len(loader), K):
        part = loader[w : w + K]
        x = torch.cat([m["x"] for m in part]).double()
        y = torch.cat([m["y"] for m in part])
        loss = nn.functional.cross_entropy(ref(x), y, reduction="sum") / (y != -100).sum()
        ref_opt.zero_grad()
        loss.backward()
        ref_opt.step()

    def objs() -> tuple[Any, ...]:
        model = model64()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        return model, opt, None, fb.Accumulator(model, opt, micro_batches=K)

    first = objs()
    model, opt, _, acc = first
    data = [{"x": m["x"].double(), "y": m["y"]} for m in loader]
    for window in acc.windows(data):
        for j, micro in enumerate(window):
            window.backward(*fb.cross_entropy_sum(model(micro["x"]), micro["y"]))
            if window.index == 1 and j == 1:
                break
        if window.index == 1:
            break
        window.step()
    states = save(model, opt, acc)
    fresh = objs()
    for obj, state in zip((fresh[0], fresh[1], fresh[3]), states, strict=True):
        obj.load_state_dict(state)
    train(fresh, data[states[2]["loader_items"] :])
    for p, q in zip(fresh[0].parameters(), ref.parameters(), strict=True):
        assert ((p - q).abs().max() / q.abs().max()).item() < 1e-12


@pytest.mark.parametrize("stop", [(1, 2), (2, 4)])
def test_counts_and_shares_resume(stop: tuple[int, int]) -> None:
    counts = {"items": lambda m: int((m["y"] != -100).sum())}
    model, _ = uninterrupted("micro_batches", counts=counts)
    fresh = resumed("micro_batches", stop, counts=counts)
    assert_bitwise(model, fresh[0])


def test_a_loaded_state_is_saved_as_loaded() -> None:
    state = mid_window_state()
    _, _, _, acc = build("micro_batches")
    acc.load_state_dict(state)
    again = acc.state_dict()
    assert again["loader_items"] == K and again["window"]["micro_batches_done"] == 2


def test_batchnorm_window_resumes_mid_window() -> None:
    with pytest.warns(UserWarning, match="BatchNorm"):
        model, _ = uninterrupted("micro_batches", batchnorm="window")
        fresh = resumed("micro_batches", (1, 2), batchnorm="window")
    assert_bitwise(model, fresh[0])  # running statistics included


def test_state_format() -> None:
    objs = build("micro_batches")
    states = train(objs, LOADERS["micro_batches"], (1, 2))
    assert states is not None
    state = states[3]
    assert state["loader_items"] == K
    assert state["steps"] == 1 and state["skipped_windows"] == 0
    assert state["mode"] == "micro_batches" and state["window_size"] == K
    assert state["world_size"] == 1 and state["rank"] == 0
    window = state["window"]
    assert window["micro_batches_done"] == 2 and window["backwards"] == 2
    assert window["loss_scale"] == state["loss_scale"]
    assert set(window["grads"]) == {n for n, _ in objs[0].named_parameters()}


# -- refused states -----------------------------------------------------------------------------


def mid_window_state(mode: str = "micro_batches") -> dict[str, Any]:
    states = train(build(mode), LOADERS[mode], (1, 2))
    assert states is not None
    return states[3]


def unchanged(acc: fb.Accumulator) -> tuple[Any, ...]:
    return (acc.steps, acc.skipped_windows, acc._engine.loss_scale, acc._engine.pending)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"world_size": 2}, "world_size=2"),
        ({"rank": 1}, "rank=1"),
        ({"mode": "micro_batch_size", "window_size": ROWS}, "saved with micro_batch_size=3, "),
        ({"window_size": K + 1}, f"saved with micro_batches={K + 1}, .* another window"),
        ({"sync": "ddp"}, "sync='ddp'"),
        ({"batchnorm": "window"}, "batchnorm='window'"),
        ({"format": 99}, "format=99"),
    ],
)
def test_refuses_another_setup(change: dict[str, Any], match: str) -> None:
    state = {**mid_window_state(), **change}
    _, _, _, acc = build("micro_batches")
    before = unchanged(acc)
    with pytest.raises(ValueError, match=match):
        acc.load_state_dict(state)
    assert unchanged(acc) == before


def test_refuses_another_model() -> None:
    state = mid_window_state()
    model = make_model(hidden=8)  # other shapes
    opt = torch.optim.AdamW(model.parameters())
    acc = fb.Accumulator(model, opt, micro_batches=K)
    with pytest.raises(ValueError, match=r"another model: parameter 0 is 0\.weight"):
        acc.load_state_dict(state)
    assert unchanged(acc) == (0, 0, None, None)
    renamed = nn.Sequential(nn.Sequential(*make_model()))
    acc = fb.Accumulator(renamed, torch.optim.AdamW(renamed.parameters()), micro_batches=K)
    with pytest.raises(ValueError, match="another model"):
        acc.load_state_dict(state)


def test_refuses_a_wrong_gradient() -> None:
    state = mid_window_state()
    state["window"]["grads"]["0.weight"] = state["window"]["grads"]["0.weight"].double()
    _, _, _, acc = build("micro_batches")
    with pytest.raises(ValueError, match=r"saved gradient of 0\.weight"):
        acc.load_state_dict(state)
    assert unchanged(acc) == (0, 0, None, None)


def test_refuses_a_state_before_the_backward() -> None:
    model, _, _, acc = build("micro_batches")
    for window in acc.windows(LOADERS["micro_batches"]):
        for micro in window:
            with pytest.raises(RuntimeError, match=r"has no backward yet.*after window\.backward"):
                acc.state_dict()
            window.backward(*fb.cross_entropy_sum(model(micro["x"]), micro["y"]))
            acc.state_dict()  # fine now
        window.step()
        break


def test_refuses_loading_inside_a_window() -> None:
    state = mid_window_state()
    _, _, _, acc = build("micro_batches")
    for _window in acc.windows(LOADERS["micro_batches"]):
        with pytest.raises(RuntimeError, match="while window 0 is open"):
            acc.load_state_dict(state)
        break


def test_a_loader_that_does_not_match_raises() -> None:
    objs = build("micro_batch_size")
    states = train(objs, LOADERS["micro_batch_size"], (1, 2))  # 2 micro-batches done
    assert states is not None
    fresh = build("micro_batch_size")
    for obj, state in zip(fresh, states, strict=True):
        obj.load_state_dict(state)
    with pytest.raises(ValueError, match=r"does not start at state\['loader_items'\] = 1"):
        for _window in fresh[3].windows([batch(0, 2)]):  # one micro-batch of 2 rows
            pass


def test_a_loader_that_ends_inside_the_done_micro_batches_raises() -> None:
    """The right first item, but the loader ends before the micro-batches already done."""
    states = train(build("micro_batches"), LOADERS["micro_batches"], (1, 2))
    assert states is not None
    fresh = build("micro_batches")
    for obj, state in zip(fresh, states, strict=True):
        obj.load_state_dict(state)
    loader = LOADERS["micro_batches"][K : K + 1]
    with pytest.raises(RuntimeError, match=r"only 1 micro-batch\(es\) but the state was taken"):
        for _window in fresh[3].windows(loader):
            pass


def test_a_scheduler_left_unloaded_raises() -> None:
    states = train(build("micro_batches"), LOADERS["micro_batches"], (1, 2))
    assert states is not None
    _, _, _, acc = build("micro_batches")
    acc.load_state_dict(states[3])
    with pytest.raises(RuntimeError, match="Load the scheduler's state_dict too"):
        next(iter(acc.windows(LOADERS["micro_batches"][K:])))


# -- the micro-batch size may change at a window boundary ---------------------------------------


def _f64_objs(size: int) -> tuple[Any, ...]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, 16), nn.Tanh(), nn.Linear(16, OUT)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)  # saved and loaded as usual
    return model, opt, sched, fb.Accumulator(model, opt, scheduler=sched, micro_batch_size=size)


@pytest.mark.parametrize("new_size", [2, 5])
def test_micro_batch_size_may_change_at_a_window_boundary(new_size: int) -> None:
    """Saved after window 1's step with micro_batch_size=3, resumed with another size: the
    run is the plain float64 full-batch run (normalization is over the whole window; only the
    rounding of the micro-batch grouping differs)."""
    data = [{"x": m["x"].double(), "y": m["y"]} for m in LOADERS["micro_batch_size"]]
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(IN, 16), nn.Tanh(), nn.Linear(16, OUT)).double()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    for item in data:
        loss = nn.functional.cross_entropy(ref(item["x"]), item["y"], reduction="sum")
        ref_opt.zero_grad()
        (loss / (item["y"] != -100).sum()).backward()
        ref_opt.step()

    first = _f64_objs(ROWS)
    states = train(first, data, (1, None))
    assert states is not None and states[3]["window"] is None
    resumed = _f64_objs(new_size)
    for obj, state in zip(resumed, states, strict=True):
        obj.load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert train(resumed, data[states[3]["loader_items"] :]) is None
    assert resumed[3].steps == len(data) and resumed[3].micro_batch_size == new_size
    for p, q in zip(resumed[0].parameters(), ref.parameters(), strict=True):
        assert ((p - q).abs().max() / q.abs().max()).item() < 1e-13


def test_micro_batch_size_change_inside_a_window_is_refused() -> None:
    state = mid_window_state("micro_batch_size")  # micro_batch_size=3, 2 micro-batches done
    model = make_model()
    acc = fb.Accumulator(model, torch.optim.AdamW(model.parameters()), micro_batch_size=2)
    before = unchanged(acc)
    match = (
        r"saved with micro_batch_size=3, but this Accumulator has micro_batch_size=2, and it "
        r"was taken inside a window, after 2 micro-batch\(es\)"
    )
    with pytest.raises(ValueError, match=match) as caught:
        acc.load_state_dict(state)
    assert "window_size" not in str(caught.value)
    assert unchanged(acc) == before


def test_micro_batches_change_is_refused_even_at_a_window_boundary() -> None:
    """micro_batches=K is the window: another K is another batch, not a micro-batch size."""
    states = train(build("micro_batches"), LOADERS["micro_batches"], (1, None))
    assert states is not None and states[3]["window"] is None
    model = make_model()
    acc = fb.Accumulator(model, torch.optim.AdamW(model.parameters()), micro_batches=K + 1)
    with pytest.raises(ValueError, match=rf"micro_batches={K}, but .* micro_batches={K + 1}"):
        acc.load_state_dict(states[3])
    assert unchanged(acc) == (0, 0, None, None)


def test_a_resumed_loader_shorter_than_a_window_is_not_warned_about() -> None:
    """Resumed inside the partial last window, the loader holds fewer than K items: right for
    a resume (the loader-length mistake check stays quiet), and bitwise the uninterrupted run."""
    want, _ = uninterrupted("micro_batches")
    assert len(LOADERS["micro_batches"]) % K == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = resumed("micro_batches", (3, 1))
    assert_bitwise(got[0], want)

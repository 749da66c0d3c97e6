"""A loss scaled by a GradScaler passed to ``window.backward``: ``window.backward(
scaler.scale(loss_sum), n)``, the hand loop's AMP recipe carried into fullbatch. Without
``scaler=`` nothing unscales it: SGD trains 255 times too far (scale 256); with ``scaler=``
it is scaled twice. Both are refused at the first backward, before anything changes; the right
form (the scaler given, the loss unscaled) equals a plain float64 full-batch SGD step, and a
0-dim factor that is no GradScaler's passes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fullbatch as fb
from fullbatch._engine import _scaled

F64 = torch.float64
LR = 0.1


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(
        F64
    )


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(10, 6, generator=g, dtype=F64)
    return {"x": x, "y": torch.randint(3, (10,), generator=g)}


def _full_batch_step() -> list[torch.Tensor]:
    """The plain reference: one mean over the 10 rows, one backward, one SGD step."""
    model, batch = _model(), _batch()
    F.cross_entropy(model(batch["x"]), batch["y"]).backward()
    return [(p - LR * p.grad).detach() for p in model.parameters()]  # type: ignore[operator]


def _train(scale_loss: bool, give_scaler: bool) -> tuple[torch.nn.Module, torch.optim.SGD, int]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    given = {"scaler": scaler} if give_scaler else {}
    with fb.Accumulator(model, opt, micro_batch_size=3, **given) as acc:
        for window in acc.windows([_batch()]):
            for micro in window:
                loss_sum, n = fb.cross_entropy_sum(model(micro["x"]), micro["y"])
                window.backward(scaler.scale(loss_sum) if scale_loss else loss_sum, n)
            window.step()
    return model, opt, acc.steps


def _error(model: torch.nn.Module, want: list[torch.Tensor]) -> float:
    start = [p.detach() for p in _model().parameters()]
    got = [p.detach() - s for p, s in zip(model.parameters(), start, strict=True)]
    ref = [w - s for w, s in zip(want, start, strict=True)]
    diff = sum(float((g - r).pow(2).sum()) for g, r in zip(got, ref, strict=True))
    return (diff / sum(float(r.pow(2).sum()) for r in ref)) ** 0.5


@pytest.mark.parametrize(
    ("give_scaler", "words"),
    [
        (False, "multiplied by a GradScaler's scale (scaler.scale(loss), scale 256) that the "
                "Accumulator was not given"),
        (True, "already scaled by the GradScaler given as scaler="),
    ],
)  # fmt: skip
def test_a_scaled_loss_is_refused_before_anything_changes(give_scaler: bool, words: str) -> None:
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    given = {"scaler": scaler} if give_scaler else {}
    with fb.Accumulator(model, opt, micro_batch_size=3, **given) as acc:
        for window in acc.windows([_batch()]):
            with pytest.raises(ValueError) as caught:
                for micro in window:
                    loss_sum, n = fb.cross_entropy_sum(model(micro["x"]), micro["y"])
                    window.backward(scaler.scale(loss_sum) / 1.0, n)
    text = str(caught.value)
    assert words in text and "nothing was changed" in text
    assert "window.backward(loss_sum, n)" in text
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters()) and not opt.state
    assert acc.steps == 0 and scaler.get_scale() == 256.0


def test_what_the_refusal_prevents_and_the_right_form(monkeypatch: pytest.MonkeyPatch) -> None:
    want = _full_batch_step()
    model, _, steps = _train(scale_loss=False, give_scaler=True)  # the right form
    assert steps == 1 and _error(model, want) < 1e-15

    with monkeypatch.context() as patch:  # the mistake as it trained before the check
        patch.setattr(_scaled.ScaledLossWatch, "before_backward", lambda *a: None)
        model, _, steps = _train(scale_loss=True, give_scaler=False)
    assert steps == 1 and _error(model, want) == pytest.approx(255.0, rel=1e-12)

    with pytest.raises(ValueError, match="that the Accumulator was not given"):
        _train(scale_loss=True, give_scaler=False)


def test_a_factor_that_is_no_grad_scalers_passes() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    weight = torch.tensor(1.0, dtype=F64)  # a 0-dim weight on the loss: the user's unit
    with fb.Accumulator(model, opt, micro_batch_size=3) as acc:
        for window in acc.windows([_batch()] * 3):
            for micro in window:
                loss_sum, n = fb.cross_entropy_sum(model(micro["x"]), micro["y"])
                window.backward(loss_sum * weight, n)
            window.step()
    assert acc.steps == 3

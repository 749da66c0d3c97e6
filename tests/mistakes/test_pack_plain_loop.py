"""Issue 26: ``pack=True`` with the plain ``for micro in window`` loop (the README's form).

Only ``window.run`` checked packing; in the plain loop a forward that leaves the cache on,
passes a 2-D mask or no ``position_ids`` let rows attend to each other and trained silently
wrong (tiny Llama, float64: 16% off the full batch here; 13-81% in the issue). Now the first
packed micro-batch of two rows is checked on the user's own forward before its backward: a
row's outputs must not depend on another row's tokens. The documented call keeps training,
exact and silent.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import fullbatch as fb
from _mistake_cases import flat, full_batch_grad, rel, tiny_llama, window
from conftest import Snapshot

pytest.importorskip("transformers")

TOKENS = 48


def documented(model, micro):
    return model(**{k: v for k, v in micro.items() if k != "labels"}).logits


def cache_left_on(model, micro):
    return model(input_ids=micro["input_ids"], position_ids=micro["position_ids"]).logits


def two_d_mask(model, micro):
    ids = micro["input_ids"]
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids),
                position_ids=micro["position_ids"], use_cache=False)  # fmt: skip
    return out.logits


def no_position_ids(model, micro):
    return model(input_ids=micro["input_ids"], use_cache=False).logits


def _train(call, **options):
    """One packed window in the plain loop; the SGD(lr=1) update and the optimizer."""
    model = tiny_llama()
    before = flat(model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
    snap = Snapshot.take(model, opt)
    with fb.Accumulator(model, opt, micro_batch_tokens=TOKENS, pack=True, **options) as acc:
        try:
            for win in acc.windows([window()]):
                for micro in win:
                    win.backward(*fb.causal_lm_loss(call(model, micro), micro["labels"]))
                win.step()
        except ValueError as error:
            snap.assert_same(model, opt)
            assert all(p.grad is None for p in model.parameters()) and acc.steps == 0
            return None, str(error)
    return before - flat(model), None


@pytest.mark.parametrize("call", [cache_left_on, two_d_mask, no_position_ids])
def test_the_opt_out_trains_wrong_as_the_old_plain_loop_did(call) -> None:
    """verify_pack=False is the old behaviour: silently off the full batch."""
    want = full_batch_grad(tiny_llama(), window())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        update, error = _train(call, verify_pack=False)
    assert error is None and rel(update, want) > 0.1


@pytest.mark.parametrize(
    ("call", "cause"),
    [
        (cache_left_on, "cache left on"),
        (two_d_mask, "a 2-D attention_mask was passed"),
        (no_position_ids, "cache left on|position_ids"),
    ],
)
def test_a_leaking_forward_raises_before_anything_changes(call, cause: str) -> None:
    update, error = _train(call)
    assert update is None and error is not None
    assert "packing does not respect the row boundaries in this loop's forward" in error
    assert any(word in error for word in cause.split("|")), error
    assert "nothing was changed" in error


def test_the_documented_call_keeps_training_exact_and_silent() -> None:
    want = full_batch_grad(tiny_llama(), window())
    rng = torch.get_rng_state()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        update, error = _train(documented)
    assert error is None and rel(update, want) < 1e-6  # float64 Llama: 5e-8 band (rotary)
    assert torch.equal(rng, torch.get_rng_state())  # the check drew nothing


def test_a_model_the_check_cannot_probe_warns_and_trains() -> None:
    """No nn.Embedding output of the packed row's shape: warned, not refused."""

    class Projected(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = torch.nn.Parameter(torch.randn(64, 8, dtype=torch.float64))
            self.out = torch.nn.Linear(8, 64).double()

        def forward(self, input_ids, **_):
            return self.out(self.table[input_ids])

    model = Projected()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="could not check that packing respects the row"):
        with fb.Accumulator(model, opt, micro_batch_tokens=TOKENS, pack=True) as acc:
            for win in acc.windows([window()]):
                for micro in win:
                    logits = model(**{k: v for k, v in micro.items() if k != "labels"})
                    win.backward(*fb.causal_lm_loss(logits, micro["labels"]))
                win.step()
    assert acc.steps == 1

"""``fb.scale_lr``: the LR for a changed global batch; accumulation itself needs no change."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

import fullbatch as fb
from conftest import class_batch, full_batch_reference, make_mlp, params, rel_err


@pytest.mark.parametrize(
    ("lr", "from_batch", "to_batch", "rule", "want"),
    [
        (0.1, 256, 1024, "linear", 0.4),
        (0.1, 1024, 256, "linear", 0.025),
        (3e-4, 64, 256, "sqrt", 6e-4),
        (3e-4, 256, 64, "sqrt", 1.5e-4),
        (1e-3, 512, 512, "linear", 1e-3),
        (1e-3, 512, 512, "sqrt", 1e-3),
        (0.5, 2.5, 10.0, "linear", 2.0),  # token counts or weights need not be integers
    ],
)
def test_rules(lr: float, from_batch: float, to_batch: float, rule: str, want: float) -> None:
    got = fb.scale_lr(lr, from_batch, to_batch, rule=rule)
    assert isinstance(got, float)
    assert got == pytest.approx(want, rel=1e-15)


def test_default_rule_is_linear_and_signature_is_the_contract() -> None:
    assert fb.scale_lr(0.1, 100, 300) == pytest.approx(0.3)
    sig = inspect.signature(fb.scale_lr)
    assert list(sig.parameters) == ["lr", "from_batch", "to_batch", "rule"]
    assert sig.parameters["rule"].default == "linear"


@pytest.mark.parametrize(
    ("args", "kwargs", "named"),
    [
        ((0.1, 0, 10), {}, "from_batch"),
        ((0.1, 10, -4), {}, "to_batch"),
        ((0.0, 10, 20), {}, "lr"),
        ((-1e-3, 10, 20), {}, "lr"),
        ((0.1, math.inf, 20), {}, "from_batch"),
        ((0.1, 10, math.nan), {}, "to_batch"),
        ((0.1, True, 20), {}, "from_batch"),
        ((0.1, "256", 512), {}, "from_batch"),
        ((0.1, 256, 512), {"rule": "Linear"}, "rule"),
        ((0.1, 256, 512), {"rule": "cubic"}, "rule"),
    ],
)
def test_bad_arguments_raise_with_the_value(args: tuple, kwargs: dict, named: str) -> None:
    with pytest.raises(ValueError) as info:
        fb.scale_lr(*args, **kwargs)
    message = str(info.value)
    assert message.startswith(named), message
    given = dict(zip(["lr", "from_batch", "to_batch"], args, strict=True), **kwargs)
    assert f"got {given[named]!r}" in message
    if named == "rule":
        assert "'linear'" in message and "'sqrt'" in message


def test_accumulation_needs_no_lr_change() -> None:
    """The LR tuned for a batch of 12 steps the same when the 12 rows come in micro-batches
    of 5, 5 and 2: the global batch did not change, so scale_lr(lr, 12, 12) == lr."""
    batch = class_batch(12, seed=3, ignore=(1, 7))
    model = make_mlp()
    ref = full_batch_reference(model, batch)
    lr = fb.scale_lr(0.3, 12, 12)
    assert lr == 0.3
    before = params(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    with fb.Accumulator(model, opt, micro_batch_size=5) as acc:
        for window in acc.windows([batch]):
            for micro in window:
                window.backward(*fb.cross_entropy_sum(model(micro["x"]), micro["y"]))
            window.step()
    update = [(b - a) / lr for b, a in zip(before, params(model), strict=True)]
    assert rel_err(update, ref.grads) < 1e-10

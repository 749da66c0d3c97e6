"""Objects that wrap what fullbatch needs: an optimizer that is not a ``torch.optim.Optimizer``
(refused with its inner optimizer named), a model whose ``.module`` is the DDP or FSDP2 model
(refused, naming ``model.module``). Each next to its nearest correct form, which stays silent."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import _colossal_cases as cc
import fullbatch as fb
from _dist import run_ranks, values
from _dist_cases import make_model, make_optimizer

pytestmark = pytest.mark.timeout(120)


class Holder:
    """A framework's optimizer wrapper that is not a torch.optim.Optimizer."""

    def __init__(self, attr: str | None, optimizer: torch.optim.Optimizer) -> None:
        if attr is not None:
            setattr(self, attr, optimizer)
        self.param_groups = optimizer.param_groups


@pytest.mark.parametrize(
    ("attr", "match"),
    [
        ("optimizer", r"test_wrapped_objects\.Holder, not a torch\.optim\.Optimizer.*"
                      r"fb\.Accumulator\(model, optimizer\.optimizer, \.\.\.\)"),
        ("optim", r"Holder, not a torch\.optim\.Optimizer.*optimizer\.optim, \.\.\.\)"),
        (None, r"Holder, not a torch\.optim\.Optimizer.*\.optim or \.optimizer"),
    ],
)  # fmt: skip
def test_an_optimizer_that_is_not_a_torch_optimizer_is_refused(
    attr: str | None, match: str
) -> None:
    """Used to fail deep inside with AttributeError (no register_step_pre_hook)."""
    model = make_model()
    opt = make_optimizer(model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=match):
        fb.Accumulator(model, Holder(attr, opt), micro_batches=2)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert not opt.state and not opt._optimizer_step_pre_hooks
    # the nearest correct form: the inner optimizer
    with fb.Accumulator(model, opt, micro_batches=2) as acc:
        assert acc.optimizer is opt


def _one_down(kind: str, inner: bool) -> list[str]:
    res: Any = values(run_ranks(cc.one_down, 2, kind, inner))
    assert res[0] == res[1]
    return res[0]


@pytest.mark.parametrize(("kind", "what"), [("ddp", "DDP-wrapped"), ("fsdp", "fully_shard'ed")])
def test_a_wrapper_around_ddp_or_fsdp2_is_refused_with_the_inner_model(
    kind: str, what: str
) -> None:
    """A user's wrapper whose ``.module`` is the DDP/FSDP2 model: fullbatch would count on one
    rank and leave the sync to the inner model. The ValueError names ``model.module`` and
    nothing is left behind; the generic "neither DDP-wrapped nor fully_shard'ed" warning does
    not fire beside it."""
    warned = _one_down(kind, inner=False)
    ours = [w for w in warned if ".module is" in w]
    assert len(ours) == 1 and ours[0].startswith("raised: "), warned
    assert "unchanged: True" in warned
    assert f"whose .module is {what}" in ours[0]
    assert "fb.Accumulator(model.module, optimizer, ...)" in ours[0]
    assert not [w for w in warned if "neither DDP-wrapped" in w], warned
    # the nearest correct form: the inner model, no warning about wrapping
    assert not [w for w in _one_down(kind, inner=True) if "module" in w or "Wrap" in w]

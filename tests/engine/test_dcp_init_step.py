"""DCP's own optimizer step inside a window is not the user's stray ``optimizer.step()``.

``torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)`` initialises an
optimizer that has no state by stepping it with zero gradients and every learning rate 0. Inside
a window (a state taken at the top of the loop body, before the first step) fullbatch lets that
step through: the parameters do not move, the learning rates and gradients are as before, and
the run is bitwise the run that called ``get_state_dict`` at the same moment outside any window.
A stray step of the user's own is still refused, even with a learning rate of 0; and an
optimizer that moves parameters under DCP's zero-learning-rate step raises naming DCP.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

import fullbatch as fb


def data() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        {"x": torch.randn(3, 4, generator=g).double(), "y": torch.randint(0, 3, (3,), generator=g)}
        for _ in range(6)
    ]


def run(optimizer: str, dcp_at: str | None) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Train 3 windows of 2; call get_state_dict ``"before"`` the loop or at the top of each
    window's body (``"inside"``: window 0's open, no gradient yet), or never."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    opt: torch.optim.Optimizer
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)  # stateless: DCP steps it every time
    if dcp_at == "before":
        get_state_dict(model, opt)
    with fb.Accumulator(model, opt, micro_batches=2) as acc:
        for window in acc.windows(data()):
            if dcp_at == "inside":
                params = [p.detach().clone() for p in model.parameters()]
                get_state_dict(model, opt)
                assert all(
                    torch.equal(a, b) for a, b in zip(params, model.parameters(), strict=True)
                )
                assert all(p.grad is None for p in model.parameters())
                assert opt.param_groups[0]["lr"] == (0.05 if optimizer == "adamw" else 0.1)
            for micro in window:
                window.backward(*fb.cross_entropy_sum(model(micro["x"]), micro["y"]))
            window.step()
    return model, opt


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_dcp_state_inside_a_window_is_silent_and_exact(optimizer: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        inside, opt = run(optimizer, "inside")
    # DCP's initialisation happens once per run either way (AdamW: a state at step 1 before
    # the first real step; SGD: no state), so the runs match bit for bit.
    before, _ = run(optimizer, "before" if optimizer == "adamw" else None)
    for a, b in zip(inside.parameters(), before.parameters(), strict=True):
        assert torch.equal(a, b)
    if optimizer == "adamw":
        assert all(float(s["step"]) == 4 for s in opt.state.values())  # DCP's 1, then 3 real


def test_a_stray_step_with_learning_rate_zero_is_still_refused() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 3).double()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    acc = fb.Accumulator(model, opt, micro_batches=2)
    for window in acc.windows(data()):
        for micro in window:
            window.backward(*fb.cross_entropy_sum(model(micro["x"]), micro["y"]))
            params = [p.detach().clone() for p in model.parameters()]
            opt.param_groups[0]["lr"] = 0.0
            with pytest.raises(
                RuntimeError, match=r"optimizer.step\(\) was called inside window 0"
            ):
                opt.step()
            assert all(torch.equal(a, b) for a, b in zip(params, model.parameters(), strict=True))
            assert not opt.state
            break
        break
    acc.close()


class _Drift(torch.optim.SGD):
    """Moves every parameter on each step, whatever its learning rate."""

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    p.add_(1.0)
                    self.state[p]["moved"] = torch.ones(())


def test_dcp_step_that_moves_parameters_raises_naming_dcp() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 3).double()
    opt = _Drift(model.parameters(), lr=0.1)
    acc = fb.Accumulator(model, opt, micro_batches=2)
    for _window in acc.windows(data()):
        with pytest.raises(RuntimeError, match=r"_init_optim_state.*moved 2 parameter") as caught:
            get_state_dict(model, opt)
        assert "once before the first window" in str(caught.value)
        break
    acc.close()

"""A ``torch.distributed.checkpoint`` call before the optimizer's first step changes an AdamW run.

    python benchmarks/dcp_first_step.py

``get_state_dict(model, optimizer)`` (and ``set_state_dict``) give an optimizer without a state
one by stepping it with zero gradients and every learning rate 0 (``_init_optim_state``, torch
2.2-2.13). The parameters do not move, but AdamW's step count is then 1: its first real step is
computed as its second (bias corrections ``1 - beta**2`` instead of ``1 - beta``: with the
default betas, every element of the first update is about 0.74 of the one a fresh AdamW takes).
Such a run is its own run (a resume from it is bitwise), but not the run without the call.

A float64 MLP, 8 windows of 4 micro-batches (fullbatch, AdamW lr 1e-2), one process. Printed:
the relative distance of the parameters from the run that never calls DCP, after the first step
and at the end, for: ``get_state_dict(model, optimizer)`` once before the first window (the
page's ``save()`` at a boundary before any step, or inside window 0 where no gradient exists
yet); and the workaround of docs/checkpointing.md, which saves the model alone
(``get_model_state_dict``) while ``optimizer.state`` is empty.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

import fullbatch as fb

K, WINDOWS = 4, 8


def data() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(K * WINDOWS):
        x = torch.randn(6, 10, generator=g, dtype=torch.float64)
        out.append({"x": x, "y": (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 0).long()})
    return out


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 3)).double()


def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def run(before_first_step: str) -> list[torch.Tensor]:
    """The parameters after every step; ``before_first_step``: what the loop calls then."""
    net = model()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    if before_first_step == "get_state_dict":
        get_state_dict(net, opt)  # steps the stateless optimizer with every lr 0
    elif before_first_step == "model only":
        if not opt.state:  # the workaround: no optimizer state to save yet
            get_model_state_dict(net)
    out = []
    with fb.Accumulator(net, opt, micro_batches=K) as acc:
        for window in acc.windows(data()):
            for micro in window:
                window.backward(*fb.cross_entropy_sum(net(micro["x"]), micro["y"]))
            window.step()
            out.append(flat(net))
    return out


def distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def main() -> None:
    plain = run("nothing")
    start = flat(model())
    head = f"{'before the first step':<26} {'first update':>14} {'after step 1':>13}"
    print(f"{head} {f'after {WINDOWS}':>10}")
    for call in ("get_state_dict", "model only"):
        got = run(call)
        ratio = ((got[0] - start).norm() / (plain[0] - start).norm()).item()
        first, last = distance(got[0], plain[0]), distance(got[-1], plain[-1])
        print(f"{call:<26} {ratio:>13.3f}x {first:>13.2e} {last:>10.2e}")


if __name__ == "__main__":
    main()

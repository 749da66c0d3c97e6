"""Resume mistakes the model and optimizer sums catch: what each would have cost, and the error.

    python benchmarks/resume_mistakes.py

A small float64 MLP, 8 windows of 4 micro-batches (AdamW, or SGD with momentum), saved after
window 2 and resumed in fresh objects with one thing wrong:

- the model's state not loaded (its fresh initialization), or loaded from the checkpoint one
  window older;
- the optimizer's state not loaded while ``get_state_dict(model, optimizer)`` gave it DCP's
  zeroed template (what a ``dcp.load`` without the optimizer's entry leaves);
- (the state saved after the first step, where the template's step count, 1, matches).

For each: whether ``acc.windows(loader)`` now raises (and the start of its message), and the
final relative error against the uninterrupted run when the check is bypassed (the state's
``fingerprints`` deleted), i.e. what the resumed run would have trained silently before.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

import fullbatch as fb

K, WINDOWS = 4, 8


def data() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(K * WINDOWS):
        x = torch.randn(6, 10, generator=g, dtype=torch.float64)
        out.append({"x": x, "y": (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 0).long()})
    return out


def build(optimizer: str, seed: int) -> tuple[Any, ...]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 3)).double()
    opt: torch.optim.Optimizer
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt, fb.Accumulator(model, opt, micro_batches=K)


def train(objs: tuple[Any, ...], loader: list[Any], stop: int | None = None) -> list[Any] | None:
    model, opt, acc = objs
    for w, window in enumerate(acc.windows(loader)):
        for micro in window:
            window.backward(*fb.cross_entropy_sum(model(micro["x"]), micro["y"]))
        window.step()
        if w == stop:
            return [
                {k: v.clone() for k, v in model.state_dict().items()},
                _clone(opt.state_dict()),
                acc.state_dict(),
            ]
    return None


def _clone(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clone(v) for v in x]
    return x


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def case(optimizer: str, mistake: str, stop: int) -> tuple[str, float]:
    loader = data()
    reference = build(optimizer, 0)
    train(reference, loader)
    states = train(build(optimizer, 0), loader, stop)
    older = train(build(optimizer, 0), loader, stop - 1) if stop else None
    assert states is not None
    outcome, error = "accepted", float("nan")
    for bypass in (False, True):
        model, opt, acc = objs = build(optimizer, 7)
        if mistake != "model not loaded":
            source = older if mistake == "model one window older" else states
            assert source is not None
            model.load_state_dict(source[0])
        if mistake == "optimizer: DCP template":
            get_state_dict(model, opt)
        else:
            opt.load_state_dict(states[1])
        acc_state = dict(states[2])
        if bypass:
            del acc_state["fingerprints"]
        acc.load_state_dict(acc_state)
        try:
            train(objs, loader[acc_state["loader_items"] :])
        except ValueError as exc:
            outcome = "ValueError: " + str(exc)[:60] + "..."
            continue
        got, want = flat(model), flat(reference[0])
        error = ((got - want).norm() / want.norm()).item()
    return outcome, error


def main() -> None:
    print(f"{'optimizer':<14} {'mistake':<26} {'saved after':>11} {'silent error':>13}  now")
    for optimizer in ("adamw", "sgd_momentum"):
        for mistake, stop in (
            ("model not loaded", 2),
            ("model one window older", 2),
            ("optimizer: DCP template", 0),
        ):
            outcome, error = case(optimizer, mistake, stop)
            print(
                f"{optimizer:<14} {mistake:<26} {f'step {stop + 1}':>11} {error:>13.2e}  {outcome}"
            )


if __name__ == "__main__":
    main()

"""Shared by the probe tests: a tiny classifier, micro-batches of uneven sizes, the hand loops
that accumulate right and wrong, and the plain full-batch reference they are judged against.

The reference never calls fullbatch: it concatenates the window's rows, takes PyTorch's own
*mean* ``F.cross_entropy`` over the counted rows (``ignore_index=-100``) and runs one backward.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import fullbatch as fb

F64 = torch.float64
IGNORE = -100
Micro = dict[str, torch.Tensor]


class Net(nn.Module):
    """``batch`` dict → logits; optional dropout and BatchNorm (they couple nothing here:
    BatchNorm runs in eval mode unless ``bn_train``)."""

    def __init__(self, *, dropout: float = 0.0, batchnorm: bool = False, classes: int = 5):
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.norm = nn.BatchNorm1d(16) if batchnorm else nn.Identity()
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(16, classes)

    def forward(self, batch: Any) -> torch.Tensor:
        x = batch["x"] if isinstance(batch, dict) else batch
        return self.out(self.drop(torch.tanh(self.norm(self.inp(x)))))


def make_net(seed: int = 0, dtype: torch.dtype = F64, **kwargs: Any) -> Net:
    torch.manual_seed(seed)
    return Net(**kwargs).to(dtype)


def micro_batches(sizes: Sequence[int], *, seed: int = 1, dtype: torch.dtype = F64) -> list[Micro]:
    """Micro-batches of ``sizes`` rows; about a fifth of the labels ignored (-100), never the
    first row's (a micro-batch without counted rows has a NaN mean loss)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes:
        labels = torch.randint(5, (n,), generator=g)
        labels[torch.rand(n, generator=g) < 0.2] = IGNORE
        labels[0] = torch.randint(5, (), generator=g)
        out.append({"x": torch.randn(n, 6, generator=g, dtype=dtype), "labels": labels})
    return out


def objective(model: nn.Module, micro: Micro) -> tuple[torch.Tensor, torch.Tensor]:
    return fb.cross_entropy_sum(model(micro), micro["labels"])


def full_batch_grad(model: nn.Module, window: Sequence[Micro]) -> list[torch.Tensor]:
    """The plain reference: the window's rows as one batch, a mean loss, one backward."""
    ref = copy.deepcopy(model)
    batch = {k: torch.cat([m[k] for m in window]) for k in window[0]}
    F.cross_entropy(ref(batch), batch["labels"], ignore_index=IGNORE).backward()
    return [p.grad.detach().clone() for p in ref.parameters()]


def rel_error(got: Sequence[torch.Tensor], ref: Sequence[torch.Tensor]) -> float:
    diff = sum(float((g.double() - r.double()).pow(2).sum()) for g, r in zip(got, ref, strict=True))
    norm = sum(float(r.double().pow(2).sum()) for r in ref)
    return (diff / norm) ** 0.5


def counted(micro: Micro) -> int:
    return int((micro["labels"] != IGNORE).sum())


def accumulate(
    model: nn.Module, window: Sequence[Micro], how: str, *, k: int | None = None
) -> None:
    """One window of backward passes, right (``"global"``) or in one of the known wrong ways.

    ``k``: the K a ``loss / K`` loop divides by (default: the window's own length).
    """
    total = sum(counted(m) for m in window)
    k = len(window) if k is None else k
    for i, micro in enumerate(window):
        logits = model(micro)
        loss_sum, _n = fb.cross_entropy_sum(logits, micro["labels"])
        mean = F.cross_entropy(logits, micro["labels"], ignore_index=IGNORE)
        if how == "global":
            (loss_sum / total).backward()
        elif how == "mean/K":  # the classic: each micro-batch's mean, divided by K
            (mean / k).backward()
        elif how == "mean":  # a mean nobody divides by K (a head that drops num_items)
            mean.backward()
        elif how == "global*K":
            (loss_sum / total * k).backward()
        elif how == "global/K":
            (loss_sum / total / k).backward()
        elif how == "drop 2" and i == 2:
            continue
        elif how == "twice 1" and i == 1:
            (loss_sum / total).backward(retain_graph=True)
            (loss_sum / total).backward()
        else:
            (loss_sum / total).backward()


def applied(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def train(
    model: nn.Module,
    windows: Sequence[Sequence[Micro]],
    how: str = "global",
    *,
    lr: float = 0.1,
    before_step: Callable[[], None] | None = None,
) -> None:
    """SGD over ``windows``, one step each, ``zero_grad`` after every step."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for window in windows:
        accumulate(model, window, how)
        if before_step is not None:
            before_step()
        opt.step()
        opt.zero_grad(set_to_none=True)

"""Shared helpers: tiny models, data with padding and ignored labels, and the plain-PyTorch
full-batch reference that every single-process test compares fullbatch against.

The reference never calls fullbatch: it is one forward of the whole batch, a *mean*
``F.cross_entropy`` (PyTorch's own ``ignore_index`` handling) and one ``backward``.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fullbatch as fb

# This machine has no accelerator: DeepSpeed, imported by transformers in any test, would
# otherwise probe for one and print "Setting accelerator to CPU" on stdout at its first import,
# into whichever docs example imports it first (tests/docs check printed output).
os.environ.setdefault("DS_ACCELERATOR", "cpu")

F64 = torch.float64
IGNORE = -100
PAD_ID = 0

Batch = dict[str, torch.Tensor]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """FSDP2 on CPU needs torch >= 2.7 (pytorch#145935): below it, those tests are skipped.

    An FSDP2 test says so in its name (fsdp, hsdp) or with the ``fsdp2`` marker.
    """
    from fullbatch._base._versions import FSDP2_CPU_TORCH, torch_version

    if torch_version() >= FSDP2_CPU_TORCH:
        return
    skip = pytest.mark.skip(
        reason=f"FSDP2 on CPU needs torch >= 2.7 (pytorch#145935), found {torch.__version__}"
    )
    for item in items:
        name = item.nodeid.lower()
        if "fsdp" in name or "hsdp" in name or item.get_closest_marker("fsdp2"):
            item.add_marker(skip)


def pytest_collection_finish(session: pytest.Session) -> None:
    """The ranks' forkserver (tests/_dist.py) imports the frameworks the collected tests
    imported, once, instead of every rank of every multi-process test importing them (about
    4 s of CPU per rank of a Hugging Face or TRL test); DeepSpeed's C++ extension starts
    building in the background (tests/_dist_ds.py)."""
    import sys

    from _dist import preload_frameworks

    preload_frameworks(sys.modules)
    if "_dist_ds" in sys.modules:  # a DeepSpeed test was collected: build its extension now
        sys.modules["_dist_ds"].start_build()


def from_fullbatch(filename: str) -> bool:
    """Whether ``filename`` is a module of the installed fullbatch package.

    By the package's real location, never a path substring: a clone is often in a folder
    named ``fullbatch``, and then the path of every file in its ``.venv`` contains that word.
    """
    package = Path(fb.__file__).resolve().parent
    return Path(filename).resolve().is_relative_to(package)


def pytest_configure(config: pytest.Config) -> None:
    # The models are tiny: one intra-op thread is fastest, and OpenMP spin-waiting on a busy
    # 2-core machine made every operation tens of times slower.
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)


# -- models ----------------------------------------------------------------------------------


class MLP(nn.Module):
    """Sample classification: ``x`` ``[B, D]`` → logits ``[B, C]``."""

    def __init__(self, d_in: int = 6, hidden: int = 8, classes: int = 5) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, hidden)
        self.out = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inp(x)))


class TinyLM(nn.Module):
    """A causal "LM" without attention: embedding → mixing layer → vocabulary projection.

    Position t sees only token t, so it is causal; trailing padding cannot change the
    logits of real positions, which lets micro-batches be trimmed to their own width.
    """

    def __init__(self, vocab: int = 17, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        return self.out(h + torch.tanh(self.mix(h)))


def make_mlp(seed: int = 0, dtype: torch.dtype = F64, **kwargs: int) -> MLP:
    torch.manual_seed(seed)
    return MLP(**kwargs).to(dtype)


def make_lm(seed: int = 0, dtype: torch.dtype = F64, vocab: int = 17, dim: int = 8) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(vocab, dim).to(dtype)


# -- data ------------------------------------------------------------------------------------


def class_batch(
    rows: int,
    seed: int = 0,
    d_in: int = 6,
    classes: int = 5,
    ignore: Sequence[int] = (),
    dtype: torch.dtype = F64,
) -> Batch:
    """``{"x", "y"}`` with ``y == -100`` at the row indices in ``ignore``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, d_in, generator=g, dtype=dtype)
    y = torch.randint(0, classes, (rows,), generator=g)
    for i in ignore:
        y[i] = IGNORE
    return {"x": x, "y": y}


def lm_batch(
    lengths: Sequence[int],
    seed: int = 0,
    vocab: int = 17,
    width: int | None = None,
    ignore_frac: float = 0.0,
) -> Batch:
    """Right-padded rows of the given lengths: ``input_ids``, ``attention_mask``, ``labels``.

    Labels are the inputs (HF convention: the model shifts), ``-100`` on padding and, with
    probability ``ignore_frac``, on real tokens too (prompt tokens).
    """
    g = torch.Generator().manual_seed(seed)
    width = width or max(lengths)
    rows = len(lengths)
    ids = torch.full((rows, width), PAD_ID, dtype=torch.long)
    mask = torch.zeros(rows, width, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(1, vocab, (n,), generator=g)
        mask[i, :n] = 1
    labels = ids.masked_fill(mask == 0, IGNORE)
    if ignore_frac:
        drop = torch.rand(rows, width, generator=g) < ignore_frac
        labels = labels.masked_fill(drop, IGNORE)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def trim(batch: Batch) -> Batch:
    """Drop trailing all-padding columns (dynamic padding: micro-batches of their own width)."""
    width = int(batch["attention_mask"].sum(dim=1).max().clamp(min=1))
    return {k: v[:, :width] for k, v in batch.items()}


def split_uneven(batch: Batch, sizes: Sequence[int], trim_width: bool = True) -> list[Batch]:
    """Consecutive micro-batches of the given row counts (each trimmed to its own width)."""
    assert sum(sizes) == next(iter(batch.values())).shape[0]
    out, start = [], 0
    for n in sizes:
        micro = {k: v[start : start + n] for k, v in batch.items()}
        out.append(trim(micro) if trim_width and "attention_mask" in micro else micro)
        start += n
    return out


def concat(micros: Sequence[Batch]) -> Batch:
    """The full batch of several micro-batches: 2-D tensors right-padded to a common width."""
    out: Batch = {}
    for key in micros[0]:
        parts = [m[key] for m in micros]
        if parts[0].dim() == 2 and parts[0].dtype == torch.long:
            width = max(p.shape[1] for p in parts)
            fill = IGNORE if key == "labels" else 0
            parts = [F.pad(p, (0, width - p.shape[1]), value=fill) for p in parts]
        out[key] = torch.cat(parts)
    return out


# -- losses: the plain-PyTorch reference and the fullbatch form ------------------------------


def ref_mean_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """The full-batch objective in plain PyTorch: a mean cross-entropy over counted items."""
    if "x" in batch:
        return F.cross_entropy(model(batch["x"]), batch["y"], ignore_index=IGNORE)
    logits = model_logits(model, batch)
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]),
        batch["labels"][:, 1:].reshape(-1),
        ignore_index=IGNORE,
    )


def model_logits(model: nn.Module, batch: Batch) -> torch.Tensor:
    if isinstance(model, TinyLM):
        return model(batch["input_ids"])
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def fb_loss(model: nn.Module, micro: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_sum, count)`` of a micro-batch with fullbatch's loss functions."""
    if "x" in micro:
        return fb.cross_entropy_sum(model(micro["x"]), micro["y"])
    return fb.causal_lm_loss(model_logits(model, micro), micro["labels"])


@dataclass
class Reference:
    loss: float
    count: int
    grads: list[torch.Tensor]
    grad_norm: float


def counted(batch: Batch) -> int:
    if "y" in batch:
        return int((batch["y"] != IGNORE).sum())
    return int((batch["labels"][:, 1:] != IGNORE).sum())


def full_batch_reference(
    model: nn.Module,
    batch: Batch,
    loss: Callable[[nn.Module, Batch], torch.Tensor] = ref_mean_loss,
) -> Reference:
    """Gradient, loss and grad norm of one full-batch step, on a copy of ``model``."""
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    value = loss(ref, batch)
    value.backward()
    grads = [
        p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        for p in ref.parameters()
    ]
    norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
    return Reference(float(value.detach()), counted(batch), grads, norm)


# -- running fullbatch -----------------------------------------------------------------------


def run_fullbatch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: Iterable[Any],
    loss: Callable[[nn.Module, Any], tuple[torch.Tensor, Any]] = fb_loss,
    after_step: Callable[[fb.StepStats], None] | None = None,
    **acc_kwargs: Any,
) -> list[fb.StepStats]:
    """The documented loop, verbatim; ``after_step`` sees the model after each step."""
    stats = []
    with fb.Accumulator(model, optimizer, **acc_kwargs) as acc:
        for window in acc.windows(loader):
            for micro in window:
                loss_sum, n = loss(model, micro)
                window.backward(loss_sum, n)
            stats.append(window.step())
            if after_step is not None:
                after_step(stats[-1])
    return stats


def params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def sgd_update(
    model: nn.Module, loader: Iterable[Any], **acc_kwargs: Any
) -> tuple[list[torch.Tensor], fb.StepStats]:
    """One fullbatch window with SGD(lr=1): the update ``p0 - p1`` *is* the gradient used."""
    before = params(model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    stats = run_fullbatch(model, opt, loader, **acc_kwargs)
    assert len(stats) == 1, f"expected one window, got {len(stats)}"
    return [b - a for b, a in zip(before, params(model), strict=True)], stats[0]


def rel_err(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> float:
    """``max |got - want| / max |want|`` over all tensors together."""
    assert len(got) == len(want)
    diff = max(float((g.double() - w.double()).abs().max()) for g, w in zip(got, want, strict=True))
    scale = max(float(w.double().abs().max()) for w in want)
    return diff / scale


def rel_err_per_tensor(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> float:
    """max over tensors of ``max |got - want| / max |want|``."""
    return max(rel_err([g], [w]) for g, w in zip(got, want, strict=True))


def assert_close_rel(got: float, want: float, rtol: float) -> None:
    assert math.isfinite(got), got
    assert abs(got - want) <= rtol * abs(want), f"{got!r} != {want!r} (rtol {rtol})"


# -- state snapshots, for "nothing changed" checks -----------------------------------------


def _clone_tree(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _clone_tree(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_clone_tree(v) for v in x)
    return copy.deepcopy(x)


def _equal_tree(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal_tree(x, y) for x, y in zip(a, b, strict=True))
    return a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b))


@dataclass
class Snapshot:
    params: list[torch.Tensor]
    optimizer: Any
    scheduler: Any

    @classmethod
    def take(cls, model: nn.Module, optimizer: Any, scheduler: Any = None) -> Snapshot:
        return cls(
            params(model),
            _clone_tree(optimizer.state_dict()),
            None if scheduler is None else _clone_tree(scheduler.state_dict()),
        )

    def assert_same(self, model: nn.Module, optimizer: Any, scheduler: Any = None) -> None:
        """Parameters, optimizer state and scheduler state are bit-for-bit as in the snapshot."""
        Snapshot.take(model, optimizer, scheduler).assert_equal(self)

    def assert_equal(self, other: Snapshot) -> None:
        for i, (a, b) in enumerate(zip(other.params, self.params, strict=True)):
            assert torch.equal(a, b), f"parameter {i} changed"
        assert _equal_tree(other.optimizer, self.optimizer), "optimizer state changed"
        assert _equal_tree(other.scheduler, self.scheduler), "scheduler state changed"

"""Lightning modules, data and the plain-PyTorch full-batch reference for the Lightning tests.

The reference never calls Lightning or the callback: for each window it pads the window's
rows (over all ranks) into one batch, runs one forward, divides the summed token loss by the
token count, runs one backward, optionally clips, and takes one optimizer step.
"""

from __future__ import annotations

import copy
import datetime
import importlib
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import nn

import fullbatch as fb

pl = pytest.importorskip("lightning.pytorch")

# Both Lightning packages: the unified `lightning` (lightning.pytorch) and the standalone
# `pytorch_lightning`; a user's Trainer comes from either.
PACKAGES = ["lightning.pytorch", "pytorch_lightning"]

VOCAB = 17
IGNORE = -100
Batch = dict[str, torch.Tensor]


def make_rows(n: int, *, seed: int, max_len: int = 9) -> list[torch.Tensor]:
    """``n`` token rows of random lengths 1..max_len (a 1-token row has no causal target)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (n,), generator=g).tolist()
    return [torch.randint(1, VOCAB, (length,), generator=g) for length in lengths]


def pad(rows: Sequence[torch.Tensor]) -> Batch:
    """Right-pad rows to the longest; labels are the ids, -100 at padding."""
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
        labels[i, : len(r)] = r
    return {"input_ids": ids, "labels": labels}


def micro_batches(rows: Sequence[torch.Tensor], sizes: Sequence[int]) -> list[Batch]:
    """Consecutive groups of ``sizes[i]`` rows, each padded to its own longest row."""
    out, start = [], 0
    for size in sizes:
        out.append(pad(rows[start : start + size]))
        start += size
    assert start == len(rows)
    return out


def loader(batches: list[Batch]) -> torch.utils.data.DataLoader:
    """A DataLoader that yields the given micro-batches as they are, in order."""
    return torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False)


def tiny_lm(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(VOCAB, 8), nn.Tanh(), nn.Linear(8, VOCAB))


class _LMBody:
    """Returns ``{"loss": loss_sum, "count": n}`` (``mean=False``) or a mean loss."""

    def __init__(
        self,
        net: nn.Module,
        *,
        mean: bool = False,
        lr: float = 0.1,
        scheduler: bool = False,
        step_output: Callable[[torch.Tensor, torch.Tensor], Any] | None = None,
    ):
        super().__init__()
        self.net = net
        self.mean = mean
        self.lr = lr
        self.scheduler = scheduler
        self.step_output = step_output

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.net(ids)
        return out.logits if hasattr(out, "logits") else out

    def training_step(self, batch: Batch, batch_idx: int) -> Any:
        loss_sum, n = fb.causal_lm_loss(self(batch["input_ids"]), batch["labels"])
        if self.step_output is not None:
            return self.step_output(loss_sum, n)
        if self.mean:
            return loss_sum / n
        return {"loss": loss_sum, "count": n}

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        if not self.scheduler:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class LM(_LMBody, pl.LightningModule):
    """The test module, a ``lightning.pytorch`` LightningModule."""


def lm_class(package: str) -> type:
    """``LM`` as a LightningModule of ``package`` (``"lightning.pytorch"`` or
    ``"pytorch_lightning"``: each package's Trainer takes only its own modules)."""
    if package == "lightning.pytorch":
        return LM
    base = importlib.import_module(package).LightningModule
    return type("LM", (_LMBody, base), {})


class Recorder(pl.Callback):
    """Copies the parameters after every optimizer step."""

    def __init__(self) -> None:
        self.params: list[list[torch.Tensor]] = []
        self._seen = 0

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        if trainer.global_step > self._seen:
            self._seen = trainer.global_step
            self.params.append([p.detach().clone() for p in pl_module.net.parameters()])


def fit(
    module: Any,
    batches: list[Batch],
    *,
    k: int,
    root: str,
    exact: bool = True,
    epochs: int = 1,
    callbacks: Sequence[Any] = (),
    package: str = "lightning.pytorch",
    **trainer_kwargs: Any,
) -> Recorder:
    """Train with ``package``'s Trainer; return the parameters after every optimizer step."""
    rec = Recorder()
    cbs = [*callbacks, rec]
    if exact:
        from fullbatch.lightning import ExactAccumulation

        cbs.insert(0, ExactAccumulation())
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "precision": "64-true",
        "max_epochs": epochs,
        "accumulate_grad_batches": k,
        "enable_checkpointing": False,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": root,
        "num_sanity_val_steps": 0,
    }
    options.update(trainer_kwargs)
    trainer = importlib.import_module(package).Trainer(callbacks=cbs, **options)
    trainer.fit(module, loader(batches))
    return rec


def reference(
    net: nn.Module,
    windows: Sequence[Sequence[torch.Tensor]],
    *,
    lr: float = 0.1,
    clip: float | None = None,
    gamma: float | None = None,
    autocast: torch.dtype | None = None,
    losses: list[float] | None = None,
) -> list[list[torch.Tensor]]:
    """Plain PyTorch, one full batch per window: the parameters after each step.

    ``losses``, when given, receives each window's mean token loss (before its step).
    """
    net = copy.deepcopy(net)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=gamma) if gamma is not None else None
    out = []
    for rows in windows:
        full = pad(rows)
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            logits = _forward(net, full["input_ids"])
        logp = torch.log_softmax(
            logits[:, :-1].to(torch.promote_types(logits.dtype, torch.float32)), -1
        )
        labels = full["labels"][:, 1:]
        keep = labels != IGNORE
        picked = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        loss = -(picked * keep).sum() / keep.sum()  # the full batch's mean token loss
        if losses is not None:
            losses.append(float(loss.detach()))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        if sched is not None:
            sched.step()
        out.append([p.detach().clone() for p in net.parameters()])
    return out


def _forward(net: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    # Lightning's "64-true" runs the forward with float64 as the default dtype (a model that
    # builds tensors in it, such as the Llama rotary embedding, computes them in float64).
    dtype = next(net.parameters()).dtype
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype if dtype == torch.float64 else before)
    try:
        out = net(ids)
    finally:
        torch.set_default_dtype(before)
    return out.logits if hasattr(out, "logits") else out


def max_diff(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> float:
    """Largest |difference| over every step and parameter (lists must be as long)."""
    assert len(a) == len(b), f"{len(a)} steps vs {len(b)}"
    return max(
        float((x - y).abs().max())
        for sa, sb in zip(a, b, strict=True)
        for x, y in zip(sa, sb, strict=True)
    )


# -- 2-process DDP --------------------------------------------------------------------


class _Env:
    """A cluster environment for ranks this test started itself: Lightning launches nothing."""

    def __new__(cls, rank: int, world: int, package: str = "lightning.pytorch") -> Any:
        environments = importlib.import_module(f"{package}.plugins.environments")
        ClusterEnvironment = environments.ClusterEnvironment

        class Env(ClusterEnvironment):
            @property
            def creates_processes_externally(self) -> bool:
                return True

            @property
            def main_address(self) -> str:
                return "127.0.0.1"  # never used: the process group already exists

            @property
            def main_port(self) -> int:
                return 0

            @staticmethod
            def detect() -> bool:
                return True

            def world_size(self) -> int:
                return world

            def set_world_size(self, size: int) -> None:
                pass

            def global_rank(self) -> int:
                return rank

            def set_global_rank(self, rank: int) -> None:
                pass

            def local_rank(self) -> int:
                return rank

            def node_rank(self) -> int:
                return 0

        return Env()


def ddp_rank(
    rank: int,
    world: int,
    per_rank: list[list[Batch]],
    k: int,
    root: str,
    package: str = "lightning.pytorch",
    plain: bool = True,
) -> tuple[list[list[torch.Tensor]], float, list[list[torch.Tensor]]]:
    """One rank of two Lightning DDP runs (``package``'s Trainer) inside an existing gloo
    process group: with ExactAccumulation (sum loss + count; returns its params and last window
    loss), then (``plain``) Lightning's own accumulation of a mean loss (its params)."""
    from fullbatch.lightning import ExactAccumulation

    DDPStrategy = importlib.import_module(f"{package}.strategies").DDPStrategy
    out = []
    cb = ExactAccumulation()
    for exact in (True, False) if plain else (True,):
        torch.manual_seed(0)
        module = lm_class(package)(tiny_lm(0), mean=not exact)
        strategy = DDPStrategy(
            cluster_environment=_Env(rank, world, package),
            process_group_backend="gloo",
            timeout=datetime.timedelta(seconds=30),
        )
        rec = fit(
            module,
            per_rank[rank],
            k=k,
            root=root,
            exact=False,
            callbacks=[cb] if exact else [],
            devices=world,
            strategy=strategy,
            use_distributed_sampler=False,  # each rank's loader already holds its own share
            package=package,
        )
        out.append(rec.params)
    return out[0], cb.loss, out[-1]

"""Lightning's own gradient accumulation vs ``fullbatch.lightning.ExactAccumulation``.

    PYTHONPATH=src python benchmarks/integration_lightning.py

The common work of the integration benchmarks: the tiny byte-level Llama
(``tiny_llama(seed=0, max_length=128, dtype=torch.float32)``), 64 standard-library docstring
rows (``read_corpus(64, seed=0)``), micro-batches of 4 right-padded rows, a window of 4
micro-batches (16 rows), SGD lr=0.1, ``precision="32-true"`` on CPU. Each run is compared with
Lightning's full batch, no accumulation: ``accumulate_grad_batches=1`` on the window's rows
padded together, ``training_step`` returning the mean token loss.

- **Lightning's own**: ``accumulate_grad_batches=4``, ``training_step`` returns each
  micro-batch's mean token loss (what the Lightning docs show); Lightning divides it by 4.
- **fullbatch**: the same Trainer with ``callbacks=[ExactAccumulation()]``, ``training_step``
  returns ``{"loss": loss_sum, "count": n}`` from ``fb.causal_lm_loss``.

Columns: the relative L2 error ``‖g − g_full‖ / ‖g_full‖`` of the gradient the optimizer
receives in the first window (read in ``on_before_optimizer_step``, after the callback),
and the largest ``|parameter difference|`` after 4 optimizer steps. Rows: 4 windows of 4
micro-batches (the 64 rows, one epoch); and a partial window: an epoch of 2 micro-batches
(rows 1-8) with ``accumulate_grad_batches=4``, run for 4 epochs (4 steps); and 2 DDP
processes (gloo, CPU) with ``accumulate_grad_batches=2`` each, rank ``r`` reading
micro-batches ``r, r+2, ...``, so that each window holds the same 16 rows as in the first row.
"""

from __future__ import annotations

import logging
import tempfile
import warnings
from typing import Any

import torch

import fullbatch as fb
from fullbatch._demo._arms import relative_error
from fullbatch._demo._corpus import make_batches, read_corpus
from fullbatch._demo._model import tiny_llama

warnings.filterwarnings("ignore")

import lightning.pytorch as pl  # noqa: E402

from fullbatch.lightning import ExactAccumulation  # noqa: E402

logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)  # after import: it sets INFO

Batch = dict[str, torch.Tensor]


class LlamaLM(pl.LightningModule):
    def __init__(self, style: str) -> None:
        super().__init__()
        self.net = tiny_llama(seed=0, max_length=128, dtype=torch.float32).model.train()
        self.style = style  # "mean" (Lightning's docs) or "sum" (fullbatch)

    def training_step(self, batch: Batch, batch_idx: int) -> Any:
        logits = self.net(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        loss_sum, n = fb.causal_lm_loss(logits.logits, batch["labels"])
        return loss_sum / n if self.style == "mean" else {"loss": loss_sum, "count": n}

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Capture(pl.Callback):
    """The gradient the optimizer receives at each step; the parameters after the run."""

    def __init__(self) -> None:
        self.grads: list[list[torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.grads.append([p.grad.detach().clone() for p in pl_module.net.parameters()])


def run(
    batches: list[Batch], *, k: int, epochs: int, style: str, exact: bool, **kwargs: Any
) -> Capture:
    cap = Capture()
    callbacks: list[pl.Callback] = [ExactAccumulation(log_name=None)] if exact else []
    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(
            accelerator="cpu",
            precision="32-true",
            max_epochs=epochs,
            accumulate_grad_batches=k,
            callbacks=[*callbacks, cap],
            enable_checkpointing=False,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root,
            num_sanity_val_steps=0,
            **kwargs,
        )
        module = LlamaLM(style)
        loader = torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False)
        trainer.fit(module, loader)
    cap.params = [p.detach().clone() for p in module.net.parameters()]  # type: ignore[attr-defined]
    assert len(cap.grads) == 4, len(cap.grads)
    return cap


class _Launched:
    """A cluster environment for ranks started here: Lightning launches nothing."""

    def __new__(cls, rank: int, world: int) -> Any:
        from lightning.fabric.plugins.environments import LightningEnvironment

        class Env(LightningEnvironment):
            @property
            def creates_processes_externally(self) -> bool:
                return True

            def world_size(self) -> int:
                return world

            def global_rank(self) -> int:
                return rank

            def local_rank(self) -> int:
                return rank

        return Env()


def ddp_rank(rank: int, world: int, store: str, out: str, micro: list[Batch], style: str) -> None:
    """One of 2 ranks: micro-batches rank, rank+2, ...; K=2 per rank makes the same windows."""
    import datetime

    import torch.distributed as dist
    from lightning.pytorch.strategies import DDPStrategy

    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    strategy = DDPStrategy(cluster_environment=_Launched(rank, world), process_group_backend="gloo")
    cap = run(
        micro[rank::world],
        k=2,
        epochs=1,
        style=style,
        exact=style == "sum",
        devices=world,
        strategy=strategy,
        use_distributed_sampler=False,
    )
    if rank == 0:
        torch.save({"grads": cap.grads, "params": cap.params}, out)  # type: ignore[attr-defined]
    dist.destroy_process_group()


def run_ddp(micro: list[Batch], style: str) -> Capture:
    import multiprocessing as mp
    import os

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "out.pt")
        procs = [
            ctx.Process(target=ddp_rank, args=(r, 2, store, out, micro, style)) for r in range(2)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=300)
            if p.is_alive():
                p.kill()
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        saved = torch.load(out)
    cap = Capture()
    cap.grads = saved["grads"]
    cap.params = saved["params"]  # type: ignore[attr-defined]
    return cap


def max_param_diff(a: Capture, b: Capture) -> float:
    pairs = zip(a.params, b.params, strict=True)  # type: ignore[attr-defined]
    return max(float((x - y).abs().max()) for x, y in pairs)


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    loaded = tiny_llama(seed=0, max_length=128, dtype=torch.float32)
    rows = read_corpus(64, seed=0, encode=loaded.encode).rows
    micro = make_batches(rows, batch_size=4, pad_id=loaded.pad_id)  # 16 micro-batches
    full = make_batches(rows, batch_size=16, pad_id=loaded.pad_id)  # 4 windows, padded together
    partial_full = make_batches(rows[:8], batch_size=8, pad_id=loaded.pad_id)

    cases = {
        "4 windows x 4 micro-batches (64 rows)": (micro, full, 1),
        "partial window: 2 of K=4 micro-batches (8 rows), 4 epochs": (micro[:2], partial_full, 4),
        "2 processes (DDP, gloo), K=2 per rank, 4 windows": (micro, full, 1),
    }
    print(
        "| work | Lightning's own: grad rel. error, window 1 | fullbatch: grad rel. error, "
        "window 1 | Lightning's own: max abs param diff, 4 steps | fullbatch: max abs param "
        "diff, 4 steps |"
    )
    print("|---|---|---|---|---|")
    for name, (micro_batches, full_batches, epochs) in cases.items():
        ref = run(full_batches, k=1, epochs=epochs, style="mean", exact=False)
        if name.startswith("2 processes"):
            own, exact = run_ddp(micro_batches, "mean"), run_ddp(micro_batches, "sum")
        else:
            own = run(micro_batches, k=4, epochs=epochs, style="mean", exact=False)
            exact = run(micro_batches, k=4, epochs=epochs, style="sum", exact=True)
        print(
            f"| {name} | {relative_error(own.grads[0], ref.grads[0]):.2e} "
            f"| {relative_error(exact.grads[0], ref.grads[0]):.2e} "
            f"| {max_param_diff(own, ref):.2e} | {max_param_diff(exact, ref):.2e} |"
        )


if __name__ == "__main__":
    main()

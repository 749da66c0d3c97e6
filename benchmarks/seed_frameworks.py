"""ColossalAI, Composer and Super-Gradients: each one's stock route, the fullbatch route, and a
hand-written full batch, on the same data and weights, in one run.

These frameworks pin an older torch than fullbatch's CI, so this script is not part of the test
suite: run it in a virtual environment where the framework installs, with fullbatch on the path
(``PYTHONPATH=src``), on CPU:

    torchrun --standalone --nproc-per-node 2 benchmarks/seed_frameworks.py composer
    torchrun --standalone --nproc-per-node 2 benchmarks/seed_frameworks.py colossalai
    python benchmarks/seed_frameworks.py super_gradients        # one process

(``benchmarks/super_gradients_exact.py`` runs ``fullbatch.super_gradients.ExactTrainer``, the
route inside Super-Gradients' own Trainer, beside its stock one.)

With ``--probe`` each route also runs, unchanged, inside ``fb.probe(objective=..., windows=1)``
(``"causal_lm"``; the two-term routes a function of both terms; ColossalAI's with ``model=`` the
boosted model, as torch 2.5.1 has no global forward hooks with keyword arguments), and the
table gains the probe's verdict, error, band and pattern beside the error measured here.

Each route trains one optimizer step (plain SGD, ``lr=1``, float64) of a tiny causal LM on the
same variable-length rows (``-100`` at padding), each rank holding different rows; the
reference is one plain PyTorch forward and backward over every rank's rows of the step, as one
batch, with the token-mean loss. Printed (rank 0): the relative error of each route's parameter
update against the reference's, and whether the ranks ended equal.

Ran on 2 CPU cores (the numbers: ``docs/integrations_frameworks.md``, "What ran where", and
``docs/probe.md``, "Engines"):

- Composer 0.32.1, torch 2.7.0 (PyPI's CUDA build, on CPU), Python 3.11.7, 2 gloo ranks.
- ColossalAI 0.5.0 (``TorchDDPPlugin``), torch 2.5.1 (below fullbatch's declared floor, 2.6:
  fullbatch from source), 2 gloo ranks.
- Super-Gradients 3.7.1, torch 2.7.0, torchvision 0.22.0, numpy 1.26.4, one process. Its
  requirements do not resolve on Python 3.11 (``numpy<=1.23`` beside ``onnxruntime==1.15.0``,
  which needs ``numpy>=1.24.2`` there): installed with ``--no-deps`` and its import-time
  dependencies one by one.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import fullbatch as fb

VOCAB, WIDTH = 23, 16
ROWS_PER_RANK, MICRO = 8, 2  # one step: 8 rows per rank in micro-batches of 2


# -- data, model, reference -----------------------------------------------------------------


def rows_of(rank: int) -> list[torch.Tensor]:
    """This rank's rows: lengths 2..12, different on every rank."""
    g = torch.Generator().manual_seed(1000 + rank)
    lengths = torch.randint(2, 13, (ROWS_PER_RANK,), generator=g).tolist()
    return [torch.randint(1, VOCAB, (n,), generator=g) for n in lengths]


def pad(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
        labels[i, : len(r)] = r
    return {"input_ids": ids, "labels": labels}


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.double()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        x = x + torch.tanh(self.mix(torch.cumsum(x, dim=1)))  # causal: a prefix sum
        return self.head(x)


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


Z_WEIGHT = 1e-2  # the second loss term's weight (a z-loss, as in PaLM)


def z_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Σ logsumexp(logits)² over the target positions (causal shift), times Z_WEIGHT."""
    keep = labels[:, 1:] != -100
    return Z_WEIGHT * torch.logsumexp(logits[:, :-1], dim=-1)[keep].square().sum()


def reference_update(world: int, z_loss: bool = False) -> torch.Tensor:
    """One SGD step (lr 1) on every rank's rows as one batch, token-mean loss (plus the
    z-loss's token mean): the update."""
    model = TinyLM()
    before = flat(model)
    batch = pad([r for rank in range(world) for r in rows_of(rank)])
    logits = model(batch["input_ids"])
    loss = nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1), ignore_index=-100
    )
    if z_loss:
        loss = loss + z_loss_sum(logits, batch["labels"]) / (batch["labels"][:, 1:] != -100).sum()
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    return flat(model) - before


class Watch:
    """``with Watch(objective) as watch:`` runs a route under ``fb.probe(objective=...,
    windows=1)`` when ``--probe`` is given (else it does nothing); :func:`report` adds what the
    probe found. The reference is computed outside the block (the probe watches every forward
    run inside it)."""

    on = False  # set by --probe

    def __init__(self, objective: Any = "causal_lm", model: nn.Module | None = None) -> None:
        self.objective, self.model = objective, model
        self.probe: Any = None
        self.raised: BaseException | None = None

    def __enter__(self) -> Watch:
        if Watch.on:
            self.probe = fb.probe(self.model, objective=self.objective, windows=1).__enter__()
        return self

    def __exit__(self, *exc: Any) -> bool:
        if self.probe is not None:
            self.probe.__exit__(*exc)
            if exc[1] is not None and isinstance(exc[1], Exception):
                self.raised = exc[1]  # the probe (or the route under it) raised: say what
                return True
        return False

    def columns(self) -> str:
        """`` verdict | error | band | pattern |`` of the probe's first window (rank 0's;
        ``ranks disagree`` when another rank's verdict differs)."""
        if self.probe is None:
            return ""
        if self.raised is not None:
            return f" raised | {type(self.raised).__name__}: {self.raised} | - | - |"
        report = self.probe.report
        ok = report.ok
        if dist.is_initialized() and dist.get_world_size() > 1:
            oks = torch.tensor([float(ok), float(ok)], dtype=torch.float64)
            oks[1] = -oks[1]
            dist.all_reduce(oks, op=dist.ReduceOp.MIN)
            if oks[0].item() != -oks[1].item():
                return f" ranks disagree ({'right' if ok else 'WRONG'} on rank 0) | - | - | - |"
        if not report.windows:
            return f" {'right' if ok else 'WRONG'} | - | - | {'; '.join(report.problems)} |"
        check = report.windows[0]
        verdict = "right" if ok else "WRONG"
        weights = [w for w in check.weights if w == w]
        detail = check.pattern
        head = check.diagnosis.split("; ")[0]
        if "not normalized: " in head:  # the constant factor: x4 (= K), ...
            factor = head.split("not normalized: ")[1].removeprefix("every micro-batch weighted ")
            detail += ("" if detail == "not normalized" else ", not normalized") + " "
            detail += factor.split(" (")[0]
        if check.pattern != "right" and weights:
            detail += f" (weights {min(weights):.2f}-{max(weights):.2f})"
        if check.pattern == "leftover gradient":
            detail += f" (leftover weight {check.leftover:.2f})"
        return f" {verdict} | {check.error:.1e} | {check.band:.1e} | {detail} |"


def report(name: str, update: torch.Tensor, ref: torch.Tensor, watch: Watch | None = None) -> None:
    """Print the route's error against the reference, whether every rank agrees, and (with
    ``--probe``) what the probe said of it."""
    error = float((update - ref).norm() / ref.norm())
    same = True
    if dist.is_initialized() and dist.get_world_size() > 1:
        mine = update.clone()
        dist.broadcast(mine, 0)
        equal = torch.tensor([float(torch.equal(mine, update))], dtype=torch.float64)
        dist.all_reduce(equal, op=dist.ReduceOp.MIN)
        same = bool(equal.item())
    probed = watch.columns() if watch is not None and Watch.on else ""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"| {name} | {error:.1e} | {'yes' if same else 'NO'} |{probed}", flush=True)


def header(framework: str, version: str, world: int) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"{framework} {version}, torch {torch.__version__}, Python "
              f"{sys.version.split()[0]}, {world} rank(s), float64, one SGD step (lr 1), "
              f"{ROWS_PER_RANK} rows per rank in micro-batches of {MICRO}")  # fmt: skip
        columns = "| route | relative error of the update vs the full batch | ranks equal |"
        if Watch.on:
            columns += " probe | probe error | probe band | probe pattern |"
        print(columns)
        print("|---" * columns.count(" |") + "|")


def init() -> tuple[int, int]:
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group("gloo")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# -- Composer ------------------------------------------------------------------------------


def composer() -> None:
    import composer as composer_pkg
    from composer import Trainer
    from composer.core import DataSpec
    from composer.models import ComposerModel

    import fullbatch.composer

    rank, world = init()
    header("Composer", composer_pkg.__version__, world)
    ref = reference_update(world)
    every = [r for other in range(world) for r in rows_of(other)]
    sampler = torch.utils.data.DistributedSampler(every, world, rank, shuffle=False)
    loader = torch.utils.data.DataLoader(
        every, batch_size=ROWS_PER_RANK, sampler=sampler, collate_fn=pad
    )

    def mean_loss(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The usual causal-LM loss: the micro-batch's token mean."""
        return nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1)
        )

    class LM(ComposerModel):
        def __init__(self, loss: Callable[[torch.Tensor, Any], Any]) -> None:
            super().__init__()
            self.net = TinyLM()
            self.loss_fn = loss

        def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
            return self.net(batch["input_ids"])

        def loss(self, outputs: torch.Tensor, batch: Any, *args: Any, **kwargs: Any) -> Any:
            return self.loss_fn(outputs, batch)

        def eval_forward(self, batch: Any, outputs: Any = None) -> Any:
            return outputs if outputs is not None else self.forward(batch)

        def get_metrics(self, is_train: bool = False) -> dict[str, Any]:
            return {}

    def run(
        loss: Callable[[torch.Tensor, Any], Any],
        spec: DataSpec,
        on_tokens: bool,
        watch: Watch | None = None,
    ) -> torch.Tensor:
        model = LM(loss)
        before = flat(model.net)
        trainer = Trainer(
            model=model,
            train_dataloader=spec,
            optimizers=torch.optim.SGD(model.parameters(), lr=1.0),
            max_duration="1ba",
            device="cpu",
            device_train_microbatch_size=MICRO,
            accumulate_train_batch_on_tokens=on_tokens,
            progress_bar=False,
            log_to_console=False,
            loggers=[],
        )
        with watch if watch is not None else contextlib.nullcontext():
            trainer.fit()
        return flat(model.net) - before

    def unshifted(batch: dict[str, torch.Tensor]) -> int:  # the lab's forgotten shift
        return int((batch["labels"] != -100).sum())

    counts = fullbatch.composer.TokenCounts(shift=True)
    watch = Watch()
    update = run(mean_loss, DataSpec(loader), on_tokens=False, watch=watch)
    report("stock: token-mean loss, accumulate on samples (the default)", update, ref, watch)
    watch = Watch()
    spec = DataSpec(loader, get_num_tokens_in_batch=unshifted)
    update = run(mean_loss, spec, on_tokens=True, watch=watch)
    report("stock: accumulate on tokens, DataSpec counts labels without the shift", update, ref,
           watch)  # fmt: skip
    watch = Watch()
    spec = DataSpec(loader, get_num_tokens_in_batch=counts)
    update = run(counts.loss, spec, on_tokens=True, watch=watch)
    report("fullbatch: accumulate on tokens, fullbatch.composer.TokenCounts", update, ref, watch)
    watched = fullbatch.composer.TokenCounts(shift=True)
    spec = DataSpec(loader, get_num_tokens_in_batch=watched.watch(unshifted))
    try:
        run(watched.loss, spec, on_tokens=True)
        verdict = "not refused"
    except ValueError as err:
        verdict = f"refused on the first micro-batch: {str(err).split(' (labels')[0]}"
    if rank == 0:
        print(f"| fullbatch check on the unshifted DataSpec count | {verdict} | - |")


# -- ColossalAI ----------------------------------------------------------------------------


def colossalai() -> None:
    import colossalai as colossalai_pkg
    from colossalai.booster import Booster
    from colossalai.booster.plugin import TorchDDPPlugin

    rank, world = init()
    header("ColossalAI", colossalai_pkg.__version__, world)
    rows = rows_of(rank)
    micro = [pad(rows[i : i + MICRO]) for i in range(0, len(rows), MICRO)]
    k = len(micro)
    ref, ref_z = reference_update(world), reference_update(world, z_loss=True)
    # --probe: fb.probe(model=the boosted model): torch 2.5.1 (ColossalAI 0.5.0's pin, below
    # fullbatch's floor) has no global forward hooks with keyword arguments.

    def boosted() -> tuple[Any, Any, torch.Tensor]:
        net = TinyLM()
        before = flat(net)
        booster = Booster(plugin=TorchDDPPlugin())
        model, optimizer, *_ = booster.boost(net, torch.optim.SGD(net.parameters(), lr=1.0))
        return (booster, model, optimizer), net, before

    def ce_and_z(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[Any, Any]:
        """The probe's objective for the two-term routes: Σ (cross-entropy + z-loss), tokens."""
        logits = model(batch["input_ids"])
        ce, tokens = fb.causal_lm_loss(logits, batch["labels"])
        return ce + z_loss_sum(logits, batch["labels"]), tokens

    # Stock: ColossalAI's documented accumulation, a token-mean loss / K, no_sync but the last.
    (booster, model, optimizer), net, before = boosted()
    with Watch(model=model) as watch:
        for i, batch in enumerate(micro):
            logits = model(batch["input_ids"])
            loss = nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1)
            )
            if i < k - 1:
                with booster.no_sync(model, optimizer):
                    booster.backward(loss / k, optimizer)
            else:
                booster.backward(loss / k, optimizer)
        optimizer.step()
    report("stock: token-mean loss / K, booster.no_sync", flat(net) - before, ref, watch)

    # Stock, two backward passes per micro-batch (ColossalAI #5601), each term divided by the
    # window's tokens over every rank (by hand: the normalization is right), no_sync but the
    # last: DDP reduces the last micro-batch's first backward only; its second stays local.
    (booster, model, optimizer), net, before = boosted()
    total = torch.tensor(sum(int(fb.count_tokens(b["labels"])) for b in micro))
    if dist.is_initialized():
        dist.all_reduce(total)
    scale = world / float(total)  # DDP averages over the ranks: x world undoes it
    with Watch(ce_and_z, model=model) as watch:
        for i, batch in enumerate(micro):
            sync = contextlib.nullcontext() if i == k - 1 else booster.no_sync(model, optimizer)
            with sync:
                logits = model(batch["input_ids"])
                ce, _ = fb.causal_lm_loss(logits, batch["labels"])
                optimizer.backward(ce * scale, retain_graph=True)
                optimizer.backward(z_loss_sum(logits, batch["labels"]) * scale)
        optimizer.step()
    report("stock: two backward passes per micro-batch, booster.no_sync", flat(net) - before,
           ref_z, watch)  # fmt: skip

    # fullbatch on the boosted objects (before fullbatch knew them: AttributeError), and the
    # boosted model with the inner optimizer (before: 16-18% off, ranks diverging).
    for name, inner in [
        ("boosted model and optimizer", False),
        ("boosted model, optimizer.optim", True),
    ]:
        (_, model, optimizer), net, before = boosted()
        try:
            acc = fb.Accumulator(model, optimizer.optim if inner else optimizer, micro_batches=k)
        except Exception as exc:  # an older fullbatch (PYTHONPATH): what it said
            if rank == 0:
                print(f"| fullbatch: fb.Accumulator({name}) | {type(exc).__name__}: {exc} | - |")
            continue
        with Watch(model=model) as watch, acc:
            for window in acc.windows(micro):
                for batch in window:
                    window.backward(*fb.causal_lm_loss(model(batch["input_ids"]), batch["labels"]))
                window.step()
        report(f"fullbatch: fb.Accumulator({name})", flat(net) - before, ref, watch)

    # Two backward passes per micro-batch (ColossalAI #5601): two terms, each by the window's
    # tokens; ddp_sync="step" reduces the gradient once at the step.
    (_, model, optimizer), net, before = boosted()
    counts = {"tokens": lambda m: int(fb.count_tokens(m["labels"]))}
    acc = fb.Accumulator(model, optimizer, micro_batches=k, counts=counts, ddp_sync="step")
    with Watch(ce_and_z, model=model) as watch, acc:
        for window in acc.windows(micro):
            tokens = window.totals["tokens"]
            for batch in window:
                logits = model(batch["input_ids"])
                ce, _ = fb.causal_lm_loss(logits, batch["labels"])
                window.backward(ce / tokens, retain_graph=True)
                window.backward(z_loss_sum(logits, batch["labels"]) / tokens)
            window.step()
    report('fullbatch: two backward passes per micro-batch, ddp_sync="step"', flat(net) - before,
           ref_z, watch)  # fmt: skip


# -- Super-Gradients -----------------------------------------------------------------------


class TokenMeanLoss(nn.Module):
    """A Super-Gradients-style loss: the micro-batch's token mean (causal shift)."""

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100
        )


def super_gradients() -> None:
    import tempfile

    import super_gradients as sg_pkg
    from super_gradients.training import Trainer

    header("Super-Gradients", sg_pkg.__version__, 1)
    rows = rows_of(0)
    micro = [pad(rows[i : i + MICRO]) for i in range(0, len(rows), MICRO)]
    k = len(micro)
    pairs = [(b["input_ids"], b["labels"]) for b in micro]
    ref = reference_update(1)

    # Stock: Trainer(batch_accumulate=K), one epoch of K micro-batches = one optimizer step.
    net = TinyLM()
    before = flat(net)

    def collate(batch_rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        batch = pad(batch_rows)
        return batch["input_ids"], batch["labels"]

    loader = torch.utils.data.DataLoader(rows, batch_size=MICRO, collate_fn=collate)  # = pairs
    params = {
        "max_epochs": 1, "lr_mode": None, "initial_lr": 1.0, "lr_warmup_epochs": 0,
        "warmup_mode": "LinearEpochLRWarmup", "optimizer": "SGD",
        "optimizer_params": {"momentum": 0.0, "weight_decay": 0.0},
        "loss": TokenMeanLoss(), "batch_accumulate": k, "ema": False,
        "mixed_precision": False, "average_best_models": False, "train_metrics_list": [],
        "valid_metrics_list": [], "metric_to_watch": "TokenMeanLoss",
        "greater_metric_to_watch_is_better": False, "save_model": False,
        "run_validation_freq": 1, "silent_mode": True,
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as root, Watch() as watch:
        trainer = Trainer(experiment_name="fullbatch_seed", ckpt_root_dir=root)
        trainer.train(model=net, training_params=params, train_loader=loader, valid_loader=loader)
    report(f"stock: Trainer(batch_accumulate={k})", flat(net) - before, ref, watch)

    # fullbatch: the same model and loss in an fb.Accumulator loop; the loss made a sum.
    net = TinyLM()
    before = flat(net)
    criterion = TokenMeanLoss()
    acc = fb.Accumulator(net, torch.optim.SGD(net.parameters(), lr=1.0), micro_batches=k)
    with Watch() as watch, acc:
        for window in acc.windows(pairs):
            for ids, labels in window:
                n = fb.count_tokens(labels)
                window.backward(criterion(net(ids), labels) * n, n)  # the mean times its tokens
            window.step()
    report("fullbatch: fb.Accumulator loop, Super-Gradients' loss x its tokens",
           flat(net) - before, ref, watch)  # fmt: skip


# -- entry point ---------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("framework", choices=["composer", "colossalai", "super_gradients"])
    parser.add_argument(
        "--probe",
        action="store_true",
        help="also run each route under fb.probe(windows=1) and print what it reported",
    )
    args = parser.parse_args()
    Watch.on = args.probe
    run = {"composer": composer, "colossalai": colossalai, "super_gradients": super_gradients}
    run[args.framework]()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""One verdict: the same non-finite window ends the same way in every wing.

Three windows of the same rows (2 micro-batches of 2 rows each) train a tiny float64 GPT-2
through ``fb.Accumulator``, ``fullbatch.hf.ExactTrainer``, ``fullbatch.trl.ExactSFTTrainer``,
Lightning's ``ExactAccumulation`` and ``fullbatch.super_gradients.ExactTrainer`` (on the tests'
stand-in without Super-Gradients; its optimizer is built by SG, with no LR schedule), with SGD
+ momentum and weight decay (optimizer state that a step would change), an LR schedule that
moves every step, and clipping at 1.0. The wings that need several processes or a DeepSpeed
engine poison a window in their own files, through the same wing window and verdict:
``fb.Pipeline`` (tests/distributed/test_distributed_verdict.py), ``fullbatch.deepspeed`` and
the Trainer on DeepSpeed (tests/_ds_cases.py, tests/_ds_trainer_cases.py: ``"nan"``,
``"no_items"``), ``ExactGRPOTrainer`` (tests/integrations/test_trl_grpo.py,
tests/_grpo_ds_cases.py). A token that only the
middle window's second micro-batch holds poisons it: its embedding output becomes NaN (a NaN
loss) or its gradient becomes inf (a finite loss, a non-finite gradient). In every wing:

- the poisoned window is skipped: parameters, optimizer state and LR scheduler state are bitwise
  what they were after the first window;
- one ``RuntimeWarning`` with the same text, pointing at the user's line (this file);
- ``steps == 2`` and one skipped window, whatever the wing calls them;
- the window after the skip trains exactly: the parameters after it equal a plain float64
  full-batch run over windows 0 and 2 (written here), to 1e-10 of the update (TRL's fused LM
  head computes log-probabilities in float32: 2e-6 there, as in tests/integrations/
  test_trl_sft.py).
"""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn

import fullbatch as fb
from conftest import Snapshot

pytest.importorskip("transformers")

from _hf_cases import has_sampling_strategy, in_order
from fullbatch.testing import tiny_causal_lm

POISON = 99  # a token id no other row holds (the data use 4..98)
K, ROWS, WINDOWS = 2, 2, 3  # micro-batches per window, rows per micro-batch; window 1 poisoned
REASONS = {"nan_loss": "non-finite loss", "inf_grad": "non-finite gradient"}
TOL, SFT_TOL = 1e-10, 2e-6


def same_text(mode: str) -> str:
    """The start of the skip warning, identical in every wing (the rest names its counters)."""
    return (
        f"window 1 was skipped ({REASONS[mode]}): parameters, optimizer and scheduler are "
        "unchanged. 1 window(s) skipped so far, 1 stepped; every skip is counted in "
    )


def data_rows() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(K * ROWS * WINDOWS):
        length = int(torch.randint(5, 13, (), generator=g))
        row = torch.randint(4, 99, (length,), generator=g).tolist()
        if i == K * ROWS + ROWS:  # window 1, micro-batch 1, its first row
            row[1] = POISON
        out.append(row)
    return out


def pad(rows: list[list[int]]) -> dict[str, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def micro_batches() -> list[dict[str, torch.Tensor]]:
    rows = data_rows()
    return [pad(rows[i : i + ROWS]) for i in range(0, len(rows), ROWS)]


def gpt2(mode: str | None) -> nn.Module:
    """The tiny float64 GPT-2, its embedding poisoned on micro-batches holding ``POISON``."""
    model = tiny_causal_lm("gpt2")

    def poison(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        if not bool((args[0] == POISON).any()):
            return out
        if mode == "nan_loss":
            return out * torch.nan
        out.register_hook(lambda g: torch.full_like(g, torch.inf))
        return out

    if mode is not None:
        model.transformer.wte.register_forward_hook(poison)
    return model


def optimizer_and_schedule(model: nn.Module) -> tuple[Any, Any]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))


def reference(schedule: bool = True) -> list[list[torch.Tensor]]:
    """Plain PyTorch: windows 0 and 2 each as one padded batch, summed loss / tokens
    (``schedule=False``: a constant learning rate, for a wing whose framework builds the
    optimizer and no scheduler)."""
    model = gpt2(None)
    opt, sched = optimizer_and_schedule(model)
    if not schedule:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    rows = data_rows()
    per_window = K * ROWS
    out = []
    for w in (0, 2):
        batch = pad(rows[w * per_window : (w + 1) * per_window])
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        labels = batch["labels"][:, 1:]
        loss = nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum"
        ) / int((labels != -100).sum())
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        out.append([p.detach().clone() for p in model.parameters()])
    return out


@dataclass
class Run:
    """What one wing did: state after each window, its counters, the warnings it raised."""

    snaps: list[Snapshot] = field(default_factory=list)
    steps: int = -1
    skipped: int = -1
    caught: list[warnings.WarningMessage] = field(default_factory=list)
    schedule: bool = True  # the run's LR moves every step (the reference's does too)
    user_files: tuple[str, ...] = (__file__,)  # where the skip warning may point


def check(run: Run, mode: str, tol: float, initial: list[torch.Tensor]) -> None:
    assert (run.steps, run.skipped) == (2, 1)
    assert len(run.snaps) == WINDOWS
    run.snaps[1].assert_equal(run.snaps[0])  # params, optimizer and scheduler: bitwise
    ref = reference(run.schedule)
    for got, want in ((run.snaps[0].params, ref[0]), (run.snaps[2].params, ref[1])):
        error = sum(float((g - w).pow(2).sum()) for g, w in zip(got, want, strict=True))
        moved = sum(float((w - p).pow(2).sum()) for w, p in zip(want, initial, strict=True))
        assert (error / moved) ** 0.5 < tol, (error / moved) ** 0.5
    skips = [w for w in run.caught if "was skipped" in str(w.message)]
    assert len(skips) == 1, [str(w.message) for w in run.caught]
    assert skips[0].category is RuntimeWarning
    assert str(skips[0].message).startswith(same_text(mode)), str(skips[0].message)
    assert skips[0].filename in run.user_files, skips[0].filename  # the user's line


def run_accumulator(mode: str) -> Run:
    model = gpt2(mode)
    opt, sched = optimizer_and_schedule(model)
    run = Run()
    acc = fb.Accumulator(model, opt, micro_batches=K, scheduler=sched, max_grad_norm=1.0)
    with warnings.catch_warnings(record=True) as run.caught:
        warnings.simplefilter("always")
        for window in acc.windows(micro_batches()):
            for micro in window:
                out = model(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"])
                window.backward(*fb.causal_lm_loss(out.logits, micro["labels"]))
            stats = window.step()
            run.snaps.append(Snapshot.take(model, opt, sched))
    assert stats.steps == acc.steps and stats.skipped_windows == acc.skipped_windows
    run.steps, run.skipped = acc.steps, acc.skipped_windows
    return run


def _trainer_run(mode: str, build: Callable[[nn.Module, Any, list[Any]], Any]) -> tuple[Run, Any]:
    """Train a Trainer wing; snapshots at each window's start (after the previous window's
    on_step_end, where a skip's schedule is put back) and after train()."""
    from transformers import TrainerCallback

    model = gpt2(mode)
    opt, sched = optimizer_and_schedule(model)
    run = Run()

    class Snap(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step > 0:
                run.snaps.append(Snapshot.take(model, opt, sched))

    trainer = build(model, (opt, sched), [Snap()])
    with warnings.catch_warnings(record=True) as run.caught:
        warnings.simplefilter("always")
        in_order(trainer).train()
    run.snaps.append(Snapshot.take(model, opt, sched))
    assert trainer.state.global_step == WINDOWS  # the Trainer counts windows
    run.steps = trainer.fb_counters.steps
    run.skipped = trainer.fb_counters.skipped_windows
    return run, trainer


def _common_args() -> dict[str, Any]:
    common = dict(
        per_device_train_batch_size=ROWS,
        gradient_accumulation_steps=K,
        max_grad_norm=1.0,
        num_train_epochs=1,
        logging_steps=1,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    if has_sampling_strategy():  # older transformers always shuffle: in_order() fixes that
        common["train_sampling_strategy"] = "sequential"
    return common


def run_exact_trainer(mode: str) -> Run:
    from transformers import TrainingArguments

    from fullbatch.hf import ExactTrainer

    rows = [{"input_ids": r} for r in data_rows()]
    tmp = tempfile.mkdtemp()

    def build(model: nn.Module, optimizers: Any, callbacks: list[Any]) -> Any:
        args = TrainingArguments(tmp, remove_unused_columns=False, **_common_args())
        return ExactTrainer(
            model=model,
            args=args,
            train_dataset=rows,
            data_collator=lambda items: pad([i["input_ids"] for i in items]),
            optimizers=optimizers,
            callbacks=callbacks,
            loss="causal_lm",
        )

    return _trainer_run(mode, build)[0]


def run_exact_sft_trainer(mode: str) -> Run:
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import SFTConfig

    from fullbatch._demo._trl_tiny import char_tokenizer
    from fullbatch.trl import ExactSFTTrainer

    tmp = tempfile.mkdtemp()

    def build(model: nn.Module, optimizers: Any, callbacks: list[Any]) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return ExactSFTTrainer(
                model=model,
                args=SFTConfig(tmp, gradient_checkpointing=False, bf16=False, **_common_args()),
                train_dataset=Dataset.from_list([{"input_ids": r} for r in data_rows()]),
                processing_class=char_tokenizer(),
                optimizers=optimizers,
                callbacks=callbacks,
            )

    return _trainer_run(mode, build)[0]


def run_lightning(mode: str) -> Run:
    pl = pytest.importorskip("lightning.pytorch")
    from fullbatch.lightning import ExactAccumulation

    model = gpt2(mode)
    opt, sched = optimizer_and_schedule(model)
    run = Run()

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
            out = self.net(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            loss_sum, n = fb.causal_lm_loss(out.logits, batch["labels"])
            return {"loss": loss_sum, "count": n}

        def configure_optimizers(self) -> Any:
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class Snap(pl.Callback):
        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, idx: int) -> None:
            if idx and idx % K == 0:
                run.snaps.append(Snapshot.take(model, opt, sched))

    callback = ExactAccumulation(log_name=None)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        precision="64-true",
        max_epochs=1,
        accumulate_grad_batches=K,
        gradient_clip_val=1.0,
        callbacks=[callback, Snap()],
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tempfile.mkdtemp(),
        num_sanity_val_steps=0,
    )
    loader = torch.utils.data.DataLoader(micro_batches(), batch_size=None, shuffle=False)
    with warnings.catch_warnings(record=True) as run.caught:
        warnings.simplefilter("always")
        trainer.fit(Module(), loader)
    run.snaps.append(Snapshot.take(model, opt, sched))
    assert trainer.global_step == WINDOWS and callback.windows == WINDOWS  # windows, as before
    run.steps, run.skipped = callback.steps, callback.skipped_windows
    return run


def run_super_gradients(mode: str, monkeypatch: pytest.MonkeyPatch) -> Run:
    """Super-Gradients' Trainer (its stand-in where SG is not installed: it builds an SGD
    optimizer from the training params and no scheduler, so the reference's LR is constant)."""
    import importlib
    import importlib.util
    import sys

    import _super_gradients_standin as standin

    real = importlib.util.find_spec("super_gradients") is not None
    if not real:
        for name, module in standin.modules().items():
            monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delitem(sys.modules, "fullbatch.super_gradients", raising=False)
    sg = importlib.import_module("fullbatch.super_gradients")
    model = gpt2(mode)
    run = Run(schedule=False, user_files=(__file__,) if real else (__file__, standin.__file__))

    class Net(nn.Module):  # SG calls net(inputs): right padding leaves a causal LM's logits be
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.net(input_ids=input_ids).logits

    class Snap:  # a phase callback: the state at each window's start after the first
        def __getattr__(self, phase: str) -> Any:
            return lambda context: None

        def on_train_batch_start(self, context: Any) -> None:
            if context.batch_idx and context.batch_idx % K == 0:
                run.snaps.append(Snapshot.take(model, context.optimizer))

    loader = [(m["input_ids"], m["labels"]) for m in micro_batches()]
    trainer = sg.ExactTrainer(experiment_name="verdict")
    params = {
        "loss": sg.SummedLoss(fb.causal_lm_loss),
        "batch_accumulate": K,
        "clip_grad_norm": 1.0,
        "max_epochs": 1,
        "initial_lr": 0.1,
        "optimizer_params": {"momentum": 0.9, "weight_decay": 0.01},
        "phase_callbacks": [Snap()],
    }
    try:
        with warnings.catch_warnings(record=True) as run.caught:
            warnings.simplefilter("always")
            trainer.train(Net(), params, train_loader=loader, valid_loader=[])
        run.snaps.append(Snapshot.take(model, trainer.optimizer))
    finally:
        sys.modules.pop("fullbatch.super_gradients", None)
        vars(fb).pop("super_gradients", None)
    run.steps, run.skipped = trainer.fb_counters.steps, trainer.fb_counters.skipped_windows
    return run


WINGS: dict[str, tuple[Callable[..., Run], float]] = {
    "Accumulator": (run_accumulator, TOL),
    "ExactTrainer": (run_exact_trainer, TOL),
    "ExactSFTTrainer": (run_exact_sft_trainer, SFT_TOL),
    "Lightning": (run_lightning, TOL),
    "SuperGradients": (run_super_gradients, TOL),
}


@pytest.mark.parametrize("mode", list(REASONS))
@pytest.mark.parametrize("wing", list(WINGS))
def test_a_non_finite_window_is_skipped_the_same_way_in_every_wing(
    wing: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    run, tol = WINGS[wing]
    initial = [p.detach().clone() for p in gpt2(None).parameters()]
    got = run(mode, monkeypatch) if run is run_super_gradients else run(mode)
    check(got, mode, tol, initial)


def test_the_reference_can_tell_a_skipped_window_from_a_stepped_one() -> None:
    """The harness is not blind: without the poison the middle window steps, and the third
    window's parameters no longer match the reference that left window 1 out."""
    model = gpt2(None)
    opt, sched = optimizer_and_schedule(model)
    acc = fb.Accumulator(model, opt, micro_batches=K, scheduler=sched, max_grad_norm=1.0)
    for window in acc.windows(micro_batches()):
        for micro in window:
            out = model(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"])
            window.backward(*fb.causal_lm_loss(out.logits, micro["labels"]))
        window.step()
    assert acc.steps == 3
    want = reference()[1]
    error = max(
        float((p.detach() - w).abs().max()) for p, w in zip(model.parameters(), want, strict=True)
    )
    assert error > 1e-4

"""Helpers for the Hugging Face Trainer tests: tiny models, real text rows, collators, runs.

Kept importable by the forkserver ranks of the DDP test (module-level functions only).
Rows carry an ``idx`` (their position in the dataset) that the collators log and drop, so a
test knows exactly which rows each micro-batch held.
"""

from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch

from fullbatch._demo._corpus import PAD_ID, VOCAB_SIZE, encode_bytes, make_batches, read_corpus

Row = dict[str, Any]


@functools.lru_cache(maxsize=4)
def _corpus_rows(n: int, max_length: int) -> tuple[tuple[int, ...], ...]:
    encode = functools.partial(encode_bytes, max_length=max_length)
    return read_corpus(n, seed=0, encode=encode).rows


def text_rows(n: int, max_length: int = 48) -> list[Row]:
    """``n`` stdlib docstrings as byte-level rows of varying length."""
    return [{"input_ids": list(r), "idx": i} for i, r in enumerate(_corpus_rows(n, max_length))]


class Collator:
    """Right-pads rows (``make_batches``), builds labels for ``kind``, logs each batch's rows."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.seen: list[list[int]] = []

    def __call__(self, rows: list[Row]) -> dict[str, torch.Tensor]:
        self.seen.append([r["idx"] for r in rows])
        batch = make_batches([r["input_ids"] for r in rows], batch_size=len(rows), pad_id=PAD_ID)[0]
        if self.kind == "masked_lm":  # every third real position is a target
            pos = torch.arange(batch["labels"].shape[1]).expand_as(batch["labels"])
            batch["labels"] = batch["labels"].masked_fill(pos % 3 != 0, -100)
        elif self.kind == "classification":  # one class per row; rows of length 5k unlabelled
            lengths = [len(r["input_ids"]) for r in rows]
            batch["labels"] = torch.tensor([-100 if n % 5 == 0 else n % 3 for n in lengths])
        elif self.kind == "no_labels":
            del batch["labels"]
        elif self.kind == "all_ignored" or (
            self.kind == "first_two_ignored" and len(self.seen) <= 2
        ):
            batch["labels"] = torch.full_like(batch["labels"], -100)
        return batch


def llama(dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    from fullbatch._demo._model import tiny_llama

    return tiny_llama(seed=0, max_length=128, dtype=dtype).model


def bert(kind: str, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    """A tiny BERT head: ``masked_lm`` or ``classification``; both drop num_items_in_batch."""
    from transformers import BertConfig, BertForMaskedLM, BertForSequenceClassification

    config = BertConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=PAD_ID,
        num_labels=3,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        head = BertForMaskedLM if kind == "masked_lm" else BertForSequenceClassification
        model = head(config)
    return model.to(dtype)


def training_args(out: str, *, k: int, batch: int, **overrides: Any) -> Any:
    from transformers import TrainingArguments

    options: dict[str, Any] = dict(
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=k,
        learning_rate=0.1,
        optim="sgd",
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,
        num_train_epochs=1,
        train_sampling_strategy="sequential",
        remove_unused_columns=False,
        logging_steps=1,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    options.update(overrides)
    missing = sorted(set(overrides) - _fields())
    if missing:
        import pytest
        import transformers

        found = transformers.__version__
        pytest.skip(f"TrainingArguments has no {missing} in transformers {found}")
    if not has_sampling_strategy():  # older transformers: see in_order()
        assert options.pop("train_sampling_strategy") == "sequential"
    return TrainingArguments(out, **options)


def _fields() -> set[str]:
    import dataclasses

    from transformers import TrainingArguments

    return {f.name for f in dataclasses.fields(TrainingArguments)}


def has_sampling_strategy() -> bool:
    return "train_sampling_strategy" in _fields()


def in_order(trainer: Any) -> Any:
    """The trainer, reading the dataset in order on every transformers version.

    ``training_args`` asks for ``train_sampling_strategy="sequential"``; TrainingArguments lacks
    that field in older transformers (4.46, 4.53), whose Trainers always shuffle, so there the
    trainer's sampler is replaced by a ``SequentialSampler`` (what "sequential" builds).
    """
    if not has_sampling_strategy():
        from torch.utils.data import SequentialSampler

        def sampler(*args: Any, **kwargs: Any) -> SequentialSampler:
            return SequentialSampler(trainer.train_dataset)

        trainer._get_train_sampler = sampler
    return trainer


def run(
    make_model: Callable[[], torch.nn.Module],
    rows: list[Row],
    kind: str,
    *,
    k: int,
    batch: int,
    exact: str | Callable[..., Any] | None = None,
    out: str | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """Train one epoch; parameters after every optimizer step, logged losses, rows per batch.

    ``exact=None`` runs the stock Trainer; otherwise ExactTrainer with ``loss=exact``.
    """
    from transformers import Trainer, TrainerCallback

    steps: list[dict[str, torch.Tensor]] = []

    class Record(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            model = kw["model"]
            steps.append({n: p.detach().clone() for n, p in model.named_parameters()})

    collator = Collator(kind)
    model = make_model()
    with tempfile.TemporaryDirectory() as tmp:
        args = training_args(out or tmp, k=k, batch=batch, **overrides)
        kwargs: dict[str, Any] = dict(
            model=model, args=args, train_dataset=rows, data_collator=collator
        )
        kwargs["callbacks"] = [Record()]
        if exact is None:
            trainer: Any = Trainer(**kwargs)
        else:
            from fullbatch.hf import ExactTrainer

            trainer = ExactTrainer(**kwargs, loss=exact)
        in_order(trainer).train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"steps": steps, "losses": losses, "seen": collator.seen, "trainer": trainer}


def rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """``‖a - b‖ / ‖b‖`` over all tensors, in float64."""
    diff = sum(float((a[n].double() - b[n].double()).pow(2).sum()) for n in b)
    ref = sum(float(b[n].double().pow(2).sum()) for n in b)
    return (diff / ref) ** 0.5


def step_errors(got: dict[str, Any], ref: dict[str, Any], start: torch.nn.Module) -> list[float]:
    """Per step: ``‖Δparams‖ / ‖ref update‖`` (relative to how far the reference moved)."""
    init = {n: p.detach() for n, p in start.named_parameters()}
    assert len(got["steps"]) == len(ref["steps"]) > 0
    out = []
    for g, r in zip(got["steps"], ref["steps"], strict=True):
        moved = {n: r[n].double() - init[n].double() for n in r}
        delta = {n: g[n].double() - init[n].double() for n in r}
        out.append(rel(delta, moved))
    return out


def ddp_rank(rank: int, world: int, k: int, batch: int, n_rows: int) -> dict[str, Any]:
    """One rank of the DDP test (the group is initialized already, tests/_dist.py): the stock
    Trainer and ExactTrainer, both with ``average_tokens_across_devices`` True and False."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="1",  # never used: accelerate finds the process group initialized
        OMP_NUM_THREADS="1",
    )
    out = {}
    for exact in ("causal_lm", None):
        for average in (True, False):
            result = run(
                llama,
                text_rows(n_rows),
                "causal_lm",
                k=k,
                batch=batch,
                exact=exact,
                average_tokens_across_devices=average,
            )
            trainer = result.pop("trainer")
            assert trainer.accelerator.num_processes == world
            assert isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel)
            out[("exact" if exact else "stock", average)] = result
    return out


def torch_reference(
    make_model: Callable[[], torch.nn.Module],
    windows: list[list[Row]],
    kind: str,
    *,
    lr: float = 0.1,
    max_grad_norm: float = 0.0,
) -> dict[str, Any]:
    """Plain PyTorch, no Trainer, no fullbatch: each window's rows as one batch, a *mean*
    ``F.cross_entropy`` (PyTorch's own ``ignore_index``), one backward, optional clipping,
    one SGD step. Parameters after every step."""
    import torch.nn.functional as F

    model = make_model().train()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    collate = Collator(kind)
    steps, losses = [], []
    for rows in windows:
        batch = collate(rows)
        labels = batch.pop("labels")
        logits = model(**batch).logits
        if kind == "causal_lm":
            logits, labels = logits[:, :-1], labels[:, 1:]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        losses.append(float(loss.detach()))
        loss.backward()
        if max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return {"steps": steps, "losses": losses}


def windows_of(rows: list[Row], size: int) -> list[list[Row]]:
    return [rows[i : i + size] for i in range(0, len(rows), size)]


def small_rows(n: int) -> list[dict[str, Any]]:
    """``n`` rows of varying length with ids the vocab-100 tiny models take (padded by the
    ``Collator`` with its pad id, mapped to 0 here)."""
    return [
        {"input_ids": [4 + (b % 95) for b in r["input_ids"]][: 6 + (i * 5) % 17], "idx": i}
        for i, r in enumerate(text_rows(n))
    ]


class SmallCollator(Collator):
    """``Collator`` with padded ids mapped to 0 (the vocab-100 tiny models' pad id)."""

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = super().__call__(rows)
        batch["input_ids"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, 0)
        return batch

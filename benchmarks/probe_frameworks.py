"""What ``fb.probe`` reports on each framework's stock accumulation, and on fullbatch's route.

    PYTHONPATH=src python benchmarks/probe_frameworks.py            # about a minute, 2 cores
    PYTHONPATH=src python benchmarks/probe_frameworks.py --markdown # the table for the docs

Every arm is the framework's documented way to accumulate, run unchanged inside
``with fb.probe(...)``; the probe checks the first optimizer step(s) and the table shows its
verdict, its error ``‖applied − reference‖ / ‖reference‖`` against the declared objective's
full-batch gradient over the same micro-batches, and its diagnosis. All models are float32
and built from a config (no download); the data: 32 standard-library docstrings as bytes
(``read_corpus``), 4 rows per micro-batch, windows of 4 micro-batches, SGD, no clipping.

- **TRL ``SFTTrainer``** on a tiny Gemma 4 (``Gemma4ForConditionalGeneration``, which drops
  ``num_items_in_batch``), prompt-completion rows, ``per_device_train_batch_size=1``,
  ``gradient_accumulation_steps=8`` (trl#2175's setting) vs ``fullbatch.trl.ExactSFTTrainer``.
- **Hugging Face ``Trainer``** on a tiny ``BertForMaskedLM`` (its head ignores
  ``num_items_in_batch``), every third token a target, vs ``fullbatch.hf.ExactTrainer``.
- **Lightning** ``accumulate_grad_batches=4`` with ``training_step`` returning each
  micro-batch's mean token loss (Lightning's docs) vs ``fullbatch.lightning.ExactAccumulation``.
- **Accelerate** ``accumulate()`` with ``outputs.loss`` (Accelerate's docs) vs ``fb.Accumulator``
  on the prepared model and optimizer.
- **hand loop, ``loss / K``**: each micro-batch's mean over 4, vs ``fb.Accumulator``.
- **hand loop, ``batch_idx % K == 0``** steps after the first micro-batch: the first window
  holds 1 micro-batch (weighted 1/4); the probe checks two windows.
- **hand loop, tail window** ``loss / K`` with a last window of 2 of 4 micro-batches
  (LLMs-from-scratch): the probe checks the whole epoch (3 windows); the row shows the tail.
- **hand loop, no ``zero_grad``** before the loop after an evaluation backward.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import math
import os
import tempfile
import warnings
from collections.abc import Callable
from typing import Any

import torch

import fullbatch as fb
from fullbatch._demo._corpus import PAD_ID, VOCAB_SIZE, encode_bytes, make_batches, read_corpus
from fullbatch._demo._model import tiny_llama

warnings.filterwarnings("ignore")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
K, MICRO_ROWS = 4, 4
Batch = dict[str, torch.Tensor]


def rows(n: int = 32) -> list[list[int]]:
    encode = lambda text: encode_bytes(text, max_length=96)  # noqa: E731
    return [list(r) for r in read_corpus(n, seed=0, encode=encode).rows]


def micro_batches(n: int = 8) -> list[Batch]:
    return make_batches(rows(n * MICRO_ROWS), batch_size=MICRO_ROWS, pad_id=PAD_ID)


def llama() -> torch.nn.Module:
    return tiny_llama(seed=0, max_length=128, dtype=torch.float32).model.train()


def mean_loss(model: torch.nn.Module, micro: Batch) -> torch.Tensor:
    return model(**micro).loss  # the micro-batch's mean token loss


def sum_loss(model: torch.nn.Module, micro: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"]).logits
    return fb.causal_lm_loss(logits, micro["labels"])


# -- hand-written loops ------------------------------------------------------------------------


def loop_loss_over_k() -> fb.probe:
    model, data = llama(), micro_batches(4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with fb.probe(objective="causal_lm") as probe:
        for micro in data:
            (mean_loss(model, micro) / K).backward()
        opt.step()
    return probe


def loop_boundary() -> fb.probe:
    model, data = llama(), micro_batches(5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with fb.probe(objective="causal_lm", windows=2) as probe:
        for batch_idx, micro in enumerate(data):
            (mean_loss(model, micro) / K).backward()
            if batch_idx % K == 0:  # steps after micro-batch 0, 4, ...
                opt.step()
                opt.zero_grad(set_to_none=True)
    return probe


def loop_tail() -> fb.probe:
    model, data = llama(), micro_batches(6)  # windows of 4, then a tail of 2
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with fb.probe(objective="causal_lm", windows=2) as probe:
        for batch_idx, micro in enumerate(data):
            (mean_loss(model, micro) / K).backward()
            if (batch_idx + 1) % K == 0 or batch_idx == len(data) - 1:
                opt.step()
                opt.zero_grad(set_to_none=True)
    return probe


def loop_no_zero_grad() -> fb.probe:
    model, data = llama(), micro_batches(5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mean_loss(model, data[4]).backward()  # an evaluation backward, never cleared
    total = sum(int((m["labels"][:, 1:] != -100).sum()) for m in data[:4])
    with fb.probe(objective="causal_lm") as probe:
        for micro in data[:4]:
            loss_sum, _ = sum_loss(model, micro)
            (loss_sum / total).backward()
        opt.step()
    return probe


def accumulator(data: list[Batch], model: torch.nn.Module | None = None, opt: Any = None,
                windows: int = 1) -> fb.probe:  # fmt: skip
    model = model if model is not None else llama()
    opt = opt if opt is not None else torch.optim.SGD(model.parameters(), lr=0.1)
    with fb.probe(objective="causal_lm", windows=windows) as probe:
        with fb.Accumulator(model, opt, micro_batches=K) as acc:
            for window in acc.windows(data):
                for micro in window:
                    window.backward(*sum_loss(model, micro))
                window.step()
    return probe


# -- Accelerate --------------------------------------------------------------------------------


def _accelerator(**kwargs: Any) -> Any:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)  # a process-wide singleton
    GradientState._reset_state()
    return Accelerator(cpu=True, **kwargs)


def accelerate_stock() -> fb.probe:
    accelerator = _accelerator(gradient_accumulation_steps=K)
    model = llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    with fb.probe(objective="causal_lm") as probe:
        for batch in micro_batches(4):
            with accelerator.accumulate(model):
                accelerator.backward(model(**batch).loss)
                opt.step()
                opt.zero_grad()
    return probe


def accelerate_exact() -> fb.probe:
    accelerator = _accelerator()
    model = llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    return accumulator(micro_batches(4), model, opt)


# -- Lightning ---------------------------------------------------------------------------------


def lightning(exact: bool) -> fb.probe:
    import lightning.pytorch as pl

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = llama()

        def training_step(self, batch: Batch, batch_idx: int) -> Any:
            loss_sum, n = sum_loss(self.net, batch)
            return {"loss": loss_sum, "count": n} if exact else loss_sum / n

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    from fullbatch.lightning import ExactAccumulation

    loader = torch.utils.data.DataLoader(micro_batches(4), batch_size=None)
    with tempfile.TemporaryDirectory() as tmp, fb.probe(objective="causal_lm") as probe:
        pl.Trainer(
            accelerator="cpu", devices=1, max_epochs=1, accumulate_grad_batches=K,
            callbacks=[ExactAccumulation(log_name=None)] if exact else [], logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=tmp,
        ).fit(LM(), loader)  # fmt: skip
    return probe


# -- Hugging Face Trainer and TRL --------------------------------------------------------------


def hf_trainer(exact: bool) -> fb.probe:
    from transformers import BertConfig, BertForMaskedLM, Trainer, TrainingArguments

    config = BertConfig(
        vocab_size=VOCAB_SIZE, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=128, pad_token_id=PAD_ID,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = BertForMaskedLM(config)

    def collate(group: list[list[int]]) -> Batch:
        batch = make_batches(group, batch_size=len(group), pad_id=PAD_ID)[0]
        pos = torch.arange(batch["labels"].shape[1]).expand_as(batch["labels"])
        batch["labels"] = batch["labels"].masked_fill(pos % 3 != 0, -100)  # every 3rd token
        return batch

    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            tmp, per_device_train_batch_size=MICRO_ROWS, gradient_accumulation_steps=K,
            learning_rate=0.1, optim="sgd", max_grad_norm=0.0, max_steps=1, use_cpu=True,
            report_to=[], save_strategy="no", disable_tqdm=True, remove_unused_columns=False,
            train_sampling_strategy="sequential",
        )  # fmt: skip
        kwargs = dict(model=model, args=args, train_dataset=rows(16), data_collator=collate)
        if exact:
            from fullbatch.hf import ExactTrainer

            trainer: Any = ExactTrainer(**kwargs, loss="token")
        else:
            trainer = Trainer(**kwargs)
        with fb.probe() as probe:  # objective inferred from the head: "token"
            trainer.train()
    return probe


def trl_sft(exact: bool) -> fb.probe:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from fullbatch._demo._trl_tiny import char_tokenizer, tiny_causal_lm
    from fullbatch.trl import ExactSFTTrainer

    words = ["ab", "cde", "fg", "hij", "klmn", "op"]
    data = Dataset.from_list([
        {"prompt": " ".join(words[(i + j) % 6] for j in range(1 + i % 4)),
         "completion": " " + " ".join(words[(2 * i + j) % 6] for j in range(1 + (i * 7) % 3))}
        for i in range(8)
    ])  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        config = SFTConfig(
            tmp, per_device_train_batch_size=1, gradient_accumulation_steps=8, learning_rate=0.1,
            optim="sgd", max_grad_norm=0.0, max_steps=1, use_cpu=True, report_to=[],
            save_strategy="no", disable_tqdm=True, train_sampling_strategy="sequential",
            bf16=False,
        )  # fmt: skip
        cls = ExactSFTTrainer if exact else SFTTrainer
        trainer = cls(
            model=tiny_causal_lm("gemma4", dtype=torch.float32), args=config, train_dataset=data,
            processing_class=char_tokenizer(),
        )  # fmt: skip
        with fb.probe() as probe:  # objective inferred from the head: "causal_lm"
            trainer.train()
    return probe


# -- the table ---------------------------------------------------------------------------------

ARMS: list[tuple[str, str, Callable[[], Any], int]] = [
    # (framework, route, run, which window to show: -1 the last)
    ("TRL SFTTrainer, Gemma 4, bs1 x GA8", "stock", lambda: trl_sft(False), 0),
    ("TRL SFTTrainer, Gemma 4, bs1 x GA8", "fullbatch.trl.ExactSFTTrainer",
     lambda: trl_sft(True), 0),
    ("HF Trainer, BertForMaskedLM", "stock", lambda: hf_trainer(False), 0),
    ("HF Trainer, BertForMaskedLM", "fullbatch.hf.ExactTrainer", lambda: hf_trainer(True), 0),
    ("Lightning accumulate_grad_batches=4", "stock", lambda: lightning(False), 0),
    ("Lightning accumulate_grad_batches=4", "fullbatch.lightning.ExactAccumulation",
     lambda: lightning(True), 0),
    ("Accelerate accumulate()", "stock", accelerate_stock, 0),
    ("Accelerate accumulate()", "fb.Accumulator", accelerate_exact, 0),
    ("hand loop, loss / K", "stock", loop_loss_over_k, 0),
    ("hand loop, loss / K", "fb.Accumulator", lambda: accumulator(micro_batches(4)), 0),
    ("hand loop, batch_idx % K == 0", "stock", loop_boundary, 0),
    ("hand loop, tail window k/K", "stock", loop_tail, -1),
    ("hand loop, tail window k/K", "fb.Accumulator",
     lambda: accumulator(micro_batches(6), windows=2), -1),
    ("hand loop, no zero_grad before the loop", "stock", loop_no_zero_grad, 0),
]  # fmt: skip


def _detail(check: Any) -> str:
    if check.pattern == "right":
        return "right"
    weights = [w for w in check.weights if math.isfinite(w)]
    spread = f"weights {min(weights):.2f}-{max(weights):.2f}" if weights else ""
    if check.pattern == "leftover gradient":
        spread = f"leftover weight {check.leftover:.2f}"
    return f"{check.pattern} ({spread})" if spread else check.pattern


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    markdown = parser.parse_args().markdown
    torch.set_num_threads(1)
    table = []
    for framework, route, run, index in ARMS:
        with contextlib.redirect_stdout(io.StringIO()) if markdown else contextlib.nullcontext():
            report = run().report
        check = report.windows[index]
        verdict = "right" if check.ok else "WRONG"
        table.append((framework, route, verdict, f"{check.error:.1e}", _detail(check)))
        if not markdown:
            print(f"\n== {framework} -- {route}\n{report}", flush=True)
    header = ("framework", "route", "verdict", "error", "diagnosis")
    if markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for row in table:
            print("| " + " | ".join(row) + " |")
        return
    widths = [max(len(r[i]) for r in [header, *table]) for i in range(len(header))]
    print()
    for row in [header, *table]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


if __name__ == "__main__":
    main()

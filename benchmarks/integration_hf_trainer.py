"""The Hugging Face Trainer's own accumulation against fullbatch's ExactTrainer, same work.

Common work of the integration benchmarks: tiny Llama (``tiny_llama(seed=0, max_length=128,
dtype=torch.float32)``), 64 stdlib docstring rows, one window = 16 rows = 4 micro-batches of
4 rows (right-padded per micro-batch, ``-100`` at padding), SGD lr=0.1, no clipping
(``max_grad_norm=0``), sequential sampling. Each recipe is compared with the Trainer's full
batch (``gradient_accumulation_steps=1``, 16 rows per batch, the same rows): the relative L2
error of the gradient the optimizer receives in the first window (from identical parameters),
and the max |parameter difference| after the 4 steps of the epoch.

Extra rows: the last partial window (8 rows: 2 of the 4 micro-batches; one step); a tiny
BERT masked-LM head (every third real token a target) on the same rows, a head that accepts
``**kwargs`` and drops ``num_items_in_batch``; and 2 DDP processes (gloo, CPU), each with
2 micro-batches of 4 rows per window, with ``average_tokens_across_devices`` True and False.

Run: ``python benchmarks/integration_hf_trainer.py`` (about a minute on 2 CPU cores).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import tempfile
from collections.abc import Callable
from typing import Any

import torch
from transformers import (
    BertConfig,
    BertForMaskedLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from fullbatch._demo._arms import relative_error
from fullbatch._demo._corpus import PAD_ID, VOCAB_SIZE, make_batches, read_corpus
from fullbatch._demo._model import tiny_llama
from fullbatch.hf import ExactTrainer

ROWS, MICRO, K = 64, 4, 4


def collate(kind: str) -> Callable[[list[dict[str, Any]]], dict[str, torch.Tensor]]:
    def fn(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = make_batches([r["input_ids"] for r in rows], batch_size=len(rows), pad_id=PAD_ID)[0]
        if kind == "token":
            pos = torch.arange(batch["labels"].shape[1]).expand_as(batch["labels"])
            batch["labels"] = batch["labels"].masked_fill(pos % 3 != 0, -100)
        return batch

    return fn


def llama() -> torch.nn.Module:
    return tiny_llama(seed=0, max_length=128, dtype=torch.float32).model


def bert_mlm() -> torch.nn.Module:
    config = BertConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=176,
        max_position_embeddings=128,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=PAD_ID,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return BertForMaskedLM(config)


def train(
    make_model: Callable[[], torch.nn.Module],
    rows: list[dict[str, Any]],
    kind: str,
    *,
    k: int,
    batch: int,
    exact: bool,
    **overrides: Any,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One epoch; the first window's gradient (as the optimizer gets it) and the final params."""
    first: dict[str, torch.Tensor] = {}

    class FirstGradient(TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if not first:
                for name, p in kw["model"].named_parameters():
                    first[name] = p.grad.detach().clone()

    model = make_model()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            out,
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
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
            seed=0,
            **overrides,
        )
        common: dict[str, Any] = dict(
            model=model,
            args=args,
            train_dataset=rows,
            data_collator=collate(kind),
            callbacks=[FirstGradient()],
        )
        trainer = ExactTrainer(**common, loss=kind) if exact else Trainer(**common)
        trainer.train()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return first, params


def grad_error(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    return relative_error([got[n] for n in ref], list(ref.values()))


def param_diff(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    return max(float((got[n] - ref[n]).abs().max()) for n in ref)


def ddp_worker(rank: int, world: int, store: str, rows: list[Any], results: Any) -> None:
    """One of 2 gloo ranks: K=2 micro-batches of 4 rows per rank, so a window is 16 rows."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.update(LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    out = []
    for recipe, exact, average in (
        ("Trainer, K=2, average_tokens_across_devices=True", False, True),
        ("Trainer, K=2, average_tokens_across_devices=False", False, False),
        ("fullbatch ExactTrainer, K=2, average_tokens_across_devices=True", True, True),
        ("fullbatch ExactTrainer, K=2, average_tokens_across_devices=False", True, False),
    ):
        grad, params = train(
            llama,
            rows,
            "causal_lm",
            k=2,
            batch=MICRO,
            exact=exact,
            average_tokens_across_devices=average,
        )
        out.append((recipe, grad, params))
    if rank == 0:  # plain pickle: tensors travel as bytes, not handles that die with the process
        results.put(pickle.dumps(out))
    dist.destroy_process_group()


def two_processes(rows: list[dict[str, Any]]) -> list[Any]:
    """Rank r reads micro-batches r, r+2, ... (sequential sampling, accelerate's sharding), so
    window w holds rows 16w..16w+15 over both ranks: the single-process full batch's rows."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=ddp_worker, args=(r, 2, store, rows, results)) for r in range(2)
        ]
        for p in procs:
            p.start()
        out = pickle.loads(results.get(timeout=300))
        for p in procs:
            p.join(timeout=60)
    return out


def main() -> None:
    torch.set_num_threads(1)
    loaded = tiny_llama(seed=0, max_length=128, dtype=torch.float32)
    corpus = read_corpus(ROWS, seed=0, encode=loaded.encode)
    rows = [{"input_ids": list(r)} for r in corpus.rows]
    cases = [
        ("tiny Llama, causal LM", llama, "causal_lm", rows, "4 x 16 rows"),
        ("tiny Llama, causal LM", llama, "causal_lm", rows[-8:], "partial: 8 rows (2 of 4)"),
        ("tiny BERT, masked LM", bert_mlm, "token", rows, "4 x 16 rows"),
    ]
    header = ("model", "windows", "recipe", "grad rel. L2 error, first window")
    print("| " + " | ".join(header) + " | max abs param diff, end |")
    print("|---|---|---|---|---|")
    for model_name, make, kind, data, windows in cases:
        ref_grad, ref_params = train(make, data, kind, k=1, batch=K * MICRO, exact=False)
        for recipe, exact in (("Trainer, K=4", False), ("fullbatch ExactTrainer, K=4", True)):
            grad, params = train(make, data, kind, k=K, batch=MICRO, exact=exact)
            print(
                f"| {model_name} | {windows} | {recipe} | {grad_error(grad, ref_grad):.1e} | "
                f"{param_diff(params, ref_params):.1e} |"
            )
    ref_grad, ref_params = train(llama, rows, "causal_lm", k=1, batch=K * MICRO, exact=False)
    for recipe, grad, params in two_processes(rows):
        print(
            f"| tiny Llama, causal LM | 2 processes, 4 x 16 rows | {recipe} | "
            f"{grad_error(grad, ref_grad):.1e} | {param_diff(params, ref_params):.1e} |"
        )


if __name__ == "__main__":
    main()

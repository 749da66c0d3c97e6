"""Helpers for the TRL tests: tiny data sets, a recording collator, a plain reference, runs.

Kept importable by the forkserver ranks of the DDP test (module-level functions only). The
reference is plain PyTorch written here: each window's documents as one right-padded batch
through a fresh copy of the model (TRL's fused head not involved), the per-token loss summed
over the window's target tokens and divided by their count, one backward, one SGD step.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from typing import Any

import torch

from fullbatch._demo._trl_tiny import char_tokenizer, tiny_causal_lm

Row = dict[str, Any]
LR = 0.1


def dataset(kind: str, n: int) -> Any:
    """``n`` rows of a TRL data set: ``"text"`` (plain LM), ``"prompt"`` (prompt-completion),
    ``"chat"`` (conversational). Lengths vary from row to row."""
    from datasets import Dataset

    words = ["ab", "cde", "fg", "hij", "klmn", "op"]
    out = []
    for i in range(n):
        a = " ".join(words[(i + j) % len(words)] for j in range(1 + i % 4))
        b = " ".join(words[(2 * i + j) % len(words)] for j in range(1 + (i * 7) % 3))
        if kind == "text":
            out.append({"text": a + " " + b})
        elif kind == "prompt":
            out.append({"prompt": a, "completion": " " + b})
        elif kind == "chat":
            out.append(
                {"messages": [{"role": "user", "content": a}, {"role": "assistant", "content": b}]}
            )
        else:
            raise ValueError(kind)
    return Dataset.from_list(out)


class Recording:
    """Wraps the trainer's collator; logs the rows (before collation) of every micro-batch."""

    def __init__(self, collate: Any) -> None:
        self.collate, self.seen = collate, []  # type: ignore[var-annotated]

    def __call__(self, rows: list[Row]) -> Any:
        keys = ("input_ids", "labels", "seq_lengths", "prompt_ids", "chosen_ids", "rejected_ids")
        self.seen.append([{k: list(r[k]) for k in keys if k in r} for r in rows])
        return self.collate(rows)


def documents(rows: list[Row]) -> list[tuple[list[int], list[int]]]:
    """``(input_ids, labels)`` of every document: packed rows split at their ``seq_lengths``."""
    docs = []
    for r in rows:
        lengths = r.get("seq_lengths", [len(r["input_ids"])])
        start = 0
        for n in lengths:
            docs.append((r["input_ids"][start : start + n], r["labels"][start : start + n]))
            start += n
    return docs


def config(out: str, *, k: int, batch: int, **overrides: Any) -> Any:
    from trl import SFTConfig

    options: dict[str, Any] = dict(
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=k,
        learning_rate=LR,
        optim="sgd",
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,
        num_train_epochs=1,
        train_sampling_strategy="sequential",
        logging_steps=1,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        gradient_checkpointing=False,
        bf16=False,
        seed=0,
    )
    options.update(overrides)
    return SFTConfig(out, **options)


def run_sft(
    model_kind: str, data: str, n: int, *, k: int, batch: int, exact: bool, **overrides: Any
) -> dict[str, Any]:
    """One epoch of (Exact)SFTTrainer; parameters after every step, logs, rows per micro-batch."""
    from transformers import TrainerCallback
    from trl import SFTTrainer

    from fullbatch.trl import ExactSFTTrainer

    steps: list[dict[str, torch.Tensor]] = []

    class Record(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            steps.append({n: p.detach().clone() for n, p in kw["model"].named_parameters()})

    cls = ExactSFTTrainer if exact else SFTTrainer
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer: Any = cls(
            model=tiny_causal_lm(model_kind),
            args=config(tmp, k=k, batch=batch, **overrides),
            train_dataset=dataset(data, n),
            processing_class=char_tokenizer(),
            callbacks=[Record()],
        )
        recording = Recording(trainer.data_collator)
        trainer.data_collator = recording
        trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {"steps": steps, "logs": logs, "seen": recording.seen, "trainer": trainer}


def windows(seen: list[list[Row]], k: int) -> list[list[Row]]:
    """The rows of each window: ``k`` consecutive micro-batches."""
    return [[r for micro in seen[w : w + k] for r in micro] for w in range(0, len(seen), k)]


def reference(
    model_kind: str, windows_: list[list[Row]], starts: list[dict], *, loss_type: str = "nll"
) -> dict:
    """Plain full batch per window (documents unpacked, right-padded), each step from the
    parameters ``starts[w]`` (those the run under test had before it): parameters after every
    step, the window's loss, entropy and top-1 accuracy over its target tokens."""
    import torch.nn.functional as F

    model = tiny_causal_lm(model_kind)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    steps, metrics = [], []
    for rows, start in zip(windows_, starts, strict=True):
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(start[n])
        docs = documents(rows)
        width = max(len(ids) for ids, _ in docs)
        ids = torch.tensor([d + [0] * (width - len(d)) for d, _ in docs])
        labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in docs])
        mask = torch.tensor([[1] * len(d) + [0] * (width - len(d)) for d, _ in docs])
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        targets = labels[:, 1:]
        keep = targets != -100
        logp = F.log_softmax(logits.double(), -1)
        token_logp = logp.gather(-1, targets.clamp(min=0)[..., None])[..., 0][keep]
        per_token = -token_logp
        if loss_type == "dft":
            per_token = per_token * token_logp.exp().detach()
        count = int(keep.sum())
        loss = per_token.sum() / count
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            entropy = -(logp.exp() * logp).sum(-1)[keep].sum() / count
            correct = (logits.argmax(-1) == targets)[keep].sum() / count
        steps.append({n: p.detach().clone() for n, p in model.named_parameters()})
        metrics.append(
            {
                "loss": float(loss.detach()),
                "entropy": float(entropy),
                "mean_token_accuracy": float(correct),
                "tokens": int(mask.sum()),
            }
        )
    return {"steps": steps, "metrics": metrics}


def starts(model_kind: str, steps: list[dict]) -> list[dict]:
    """The parameters before each step: the initial ones, then those after each step."""
    init = {n: p.detach().clone() for n, p in tiny_causal_lm(model_kind).named_parameters()}
    return [init, *steps[:-1]]


def step_errors(got: list[dict], ref: list[dict], before: list[dict]) -> list[float]:
    """Per step ``‖got - ref‖ / ‖ref - before‖``: both steps taken from the same parameters."""
    assert len(got) == len(ref) == len(before) > 0
    out = []
    for g, r, b in zip(got, ref, before, strict=True):
        diff = sum(float((g[n].double() - r[n].double()).pow(2).sum()) for n in r)
        moved = sum(float((r[n].double() - b[n].double()).pow(2).sum()) for n in r)
        out.append((diff / moved) ** 0.5)
    return out


def ddp_rank(rank: int, world: int) -> dict[str, Any]:
    """One rank of the DDP test (group initialized, tests/_dist.py): ExactSFTTrainer on Gemma 4,
    prompt-completion rows, then ExactDPOTrainer (sigmoid + sft) on Llama; 1 row or pair per
    micro-batch, K=2, 10 rows or pairs: windows of 4, 4, 2."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT="1", OMP_NUM_THREADS="1",
    )  # fmt: skip
    import torch.distributed as dist

    calls = {"all_reduce": 0}
    original = dist.all_reduce

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls["all_reduce"] += 1
        return original(*args, **kwargs)

    from _trl_dpo_cases import run_dpo

    dist.all_reduce = counting  # type: ignore[assignment]
    try:
        result = run_sft("gemma4", "prompt", 10, k=2, batch=1, exact=True)
        result["all_reduce"] = calls["all_reduce"]
        trainer = result.pop("trainer")
        assert isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel)
        calls["all_reduce"] = 0
        dpo = run_dpo(10, k=2, batch=1, exact=True, loss_type=["sigmoid", "sft"],
                      loss_weights=[1.0, 0.5])  # fmt: skip
        dpo["all_reduce"] = calls["all_reduce"]
    finally:
        dist.all_reduce = original  # type: ignore[assignment]
    return {"sft": result, "dpo": dpo}

"""TRL's SFTTrainer and DPOTrainer against fullbatch.trl's, same rows, one optimizer step.

The seed's experiment (trl issue 2175: ``per_device_train_batch_size=1,
gradient_accumulation_steps=32`` trained worse than batch 32) at small scale: tiny float64
models built from a config (Llama; Gemma 4, the ``Gemma4ForConditionalGeneration`` that
``AutoModelForCausalLM`` builds, which drops ``num_items_in_batch``; GPT-2), a character
tokenizer, 8 rows (SFT) or 8 pairs (DPO), SGD lr=0.1, no clipping, sequential sampling, one
optimizer step. Each run is compared with a plain full batch written here (the recorded rows
of that step as one right-padded batch, documents unpacked, float64 PyTorch, no TRL): the
relative L2 error of the parameter update. TRL's fused LM head and some norms compute in
float32, so ~1e-7 is the floor of every model here (TRL's own full batch included).

Run: ``python benchmarks/integration_trl.py`` (about a minute on 2 CPU cores).
"""

from __future__ import annotations

import logging
import os
import tempfile
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from datasets import Dataset
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

from fullbatch.testing import char_tokenizer, tiny_causal_lm
from fullbatch.trl import ExactDPOTrainer, ExactSFTTrainer

LR, BETA = 0.1, 0.1
WORDS = ["ab", "cde", "fg", "hij", "klmn", "op"]
COMMON: dict[str, Any] = dict(
    learning_rate=LR, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0,
    max_grad_norm=0.0, max_steps=1, train_sampling_strategy="sequential", use_cpu=True,
    report_to=[], save_strategy="no", disable_tqdm=True, gradient_checkpointing=False,
    bf16=False, logging_steps=1, seed=0,
)  # fmt: skip


def sft_rows(kind: str, n: int = 24) -> Dataset:
    out = []
    for i in range(n):
        a = " ".join(WORDS[(i + j) % 6] for j in range(1 + i % 4))
        b = " ".join(WORDS[(2 * i + j) % 6] for j in range(1 + (i * 7) % 3))
        out.append(
            {"text": f"{a} {b}"} if kind != "completion" else {"prompt": a, "completion": " " + b}
        )
    return Dataset.from_list(out)


def pairs(n: int = 8) -> Dataset:
    return Dataset.from_list(
        [{"prompt": "ab " * (1 + i % 3), "chosen": "cd " * (1 + (i * 2) % 5) + "x",
          "rejected": "e" * (1 + (i * 5) % 4)} for i in range(n)]
    )  # fmt: skip


class Recording:
    def __init__(self, collate: Any) -> None:
        self.collate, self.rows = collate, []  # type: ignore[var-annotated]

    def __call__(self, rows: list[dict[str, Any]]) -> Any:
        self.rows += [dict(r) for r in rows]
        return self.collate(rows)


def train_once(cls: Any, config: Any, model_kind: str, data: Dataset, **kw: Any) -> tuple:
    """One step; (parameters before, after, the step's rows). The loader reads one batch ahead
    (accelerate), so the rows recorded beyond the step's are dropped."""
    model = tiny_causal_lm(model_kind)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = cls(model=model, args=config, train_dataset=data,
                      processing_class=char_tokenizer(), **kw)  # fmt: skip
        recording = Recording(trainer.data_collator)
        trainer.data_collator = recording
        trainer.train()
    used = config.per_device_train_batch_size * config.gradient_accumulation_steps
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    return before, after, recording.rows[:used]


def _pad(seqs: list[list[int]], fill: int) -> torch.Tensor:
    width = max(len(s) for s in seqs)
    return torch.tensor([list(s) + [fill] * (width - len(s)) for s in seqs])


def _token_logps(model: Any, seqs: list[list[int]], targets: list[list[int]]) -> tuple:
    """Per token log p(target) at every shifted position, and the mask of counted targets."""
    ids, attn = _pad(seqs, 0), _pad([[1] * len(s) for s in seqs], 0)
    labels = _pad(targets, -100)[:, 1:]
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].double()
    logp = F.log_softmax(logits, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    keep = labels != -100
    return logp * keep, keep


def sft_reference(model_kind: str, rows: list[dict[str, Any]], step: dict) -> dict:
    """The plain full batch: documents unpacked, Σ -log p over the targets / their count."""
    docs = []
    for r in rows:
        start = 0
        for n in r.get("seq_lengths", [len(r["input_ids"])]):
            docs.append((r["input_ids"][start : start + n], r["labels"][start : start + n]))
            start += n
    model = tiny_causal_lm(model_kind)
    logp, keep = _token_logps(model, [d for d, _ in docs], [lab for _, lab in docs])
    (-logp.sum() / keep.sum()).backward()
    return {n: step[n] - LR * p.grad for n, p in model.named_parameters()}


def dpo_reference(rows: list[dict[str, Any]], step: dict, weights: tuple) -> dict:
    model, ref = tiny_causal_lm("llama"), tiny_causal_lm("llama")
    prompts = [r["prompt_ids"] for r in rows]

    def seq_logps(m: Any, key: str) -> tuple:
        comps = [r[key] for r in rows]
        seqs = [p + c for p, c in zip(prompts, comps, strict=True)]
        targets = [[-100] * len(p) + c for p, c in zip(prompts, comps, strict=True)]
        logp, keep = _token_logps(m, seqs, targets)
        return logp.sum(1), logp, keep

    pc, token_c, keep_c = seq_logps(model, "chosen_ids")
    pr, _, _ = seq_logps(model, "rejected_ids")
    with torch.no_grad():
        rc, rr = seq_logps(ref, "chosen_ids")[0], seq_logps(ref, "rejected_ids")[0]
    sigmoid = -F.logsigmoid(BETA * ((pc - rc) - (pr - rr))).mean()
    (weights[0] * sigmoid - weights[1] * token_c.sum() / keep_c.sum()).backward()
    return {n: step[n] - LR * p.grad for n, p in model.named_parameters()}


def error(before: dict, after: dict, ref: dict) -> float:
    diff = sum(float((after[n] - ref[n]).pow(2).sum()) for n in ref)
    moved = sum(float((ref[n] - before[n]).pow(2).sum()) for n in ref)
    return (diff / moved) ** 0.5


def sft_table() -> list[str]:
    lines = ["| model | data | stock TRL bs1×GA8 | stock TRL bs8×GA1 | fullbatch bs1×GA8 "
             "| fullbatch bs8×GA1 |", "|---|---|---|---|---|---|"]  # fmt: skip
    data_kinds = {"plain": {}, "completion-only": {}, "packed (BFD)": {"packing": True,
                  "max_length": 24}}  # fmt: skip
    for model_kind in ("llama", "gemma4", "gpt2"):
        for data_name, options in data_kinds.items():
            if model_kind == "gpt2" and data_name != "plain":
                continue
            data = sft_rows("completion" if data_name == "completion-only" else "text")
            cells = []
            for cls in (SFTTrainer, ExactSFTTrainer):
                for batch, k in ((1, 8), (8, 1)):
                    with tempfile.TemporaryDirectory() as tmp:
                        config = SFTConfig(
                            tmp,
                            per_device_train_batch_size=batch,
                            gradient_accumulation_steps=k,
                            **options,
                            **COMMON,
                        )
                        before, after, rows = train_once(cls, config, model_kind, data)
                    cells.append(error(before, after, sft_reference(model_kind, rows, before)))
            lines.append(
                f"| {model_kind} | {data_name} | " + " | ".join(f"{e:.1e}" for e in cells) + " |"
            )
    return lines


def dpo_table() -> list[str]:
    lines = ["| loss | stock TRL bs1×GA4 | stock TRL bs2×GA2 | fullbatch bs1×GA4 "
             "| fullbatch bs2×GA2 |", "|---|---|---|---|---|"]  # fmt: skip
    for name, types, weights in (("sigmoid + sft (RPO)", ["sigmoid", "sft"], (1.0, 1.0)),
                                 ("sigmoid", ["sigmoid"], (1.0, 0.0))):  # fmt: skip
        cells = []
        for cls in (DPOTrainer, ExactDPOTrainer):
            for batch, k in ((1, 4), (2, 2)):
                with tempfile.TemporaryDirectory() as tmp:
                    config = DPOConfig(
                        tmp,
                        per_device_train_batch_size=batch,
                        beta=BETA,
                        gradient_accumulation_steps=k,
                        loss_type=types,
                        loss_weights=list(weights[: len(types)]),
                        **COMMON,
                    )
                    before, after, rows = train_once(
                        cls, config, "llama", pairs(), ref_model=tiny_causal_lm("llama")
                    )
                cells.append(error(before, after, dpo_reference(rows, before, weights)))
        lines.append(f"| {name} | " + " | ".join(f"{e:.1e}" for e in cells) + " |")
    return lines


def main() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", FutureWarning)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    import datasets

    datasets.disable_progress_bars()
    print("SFT: relative error of one step's update against the plain full batch (8 rows)")
    print("\n".join(sft_table()))
    print()
    print("DPO (tiny Llama): the same, 4 pairs per step")
    print("\n".join(dpo_table()))


if __name__ == "__main__":
    main()

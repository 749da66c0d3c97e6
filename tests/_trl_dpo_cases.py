"""Helpers for the ExactDPOTrainer tests: preference pairs, runs, a plain reference.

The reference is plain PyTorch written here: for each window, every pair's chosen and rejected
completion log-probabilities (summed over completion tokens) under the policy and under the
frozen initial model, ``w_sigmoid · mean_pairs(-log σ(β Δ)) + w_sft · Σ chosen -log p / chosen
tokens`` over the whole window, one backward, one SGD step from the given parameters.
"""

from __future__ import annotations

import tempfile
import warnings
from typing import Any

import torch
import torch.nn.functional as F

from _trl_cases import LR, Recording
from fullbatch._demo._trl_tiny import char_tokenizer, tiny_causal_lm

BETA = 0.1


def pairs(n: int) -> Any:
    from datasets import Dataset

    return Dataset.from_list(
        [
            {"prompt": "ab " * (1 + i % 3), "chosen": "cd " * (1 + (i * 2) % 5) + "x",
             "rejected": "e" * (1 + (i * 5) % 4)}
            for i in range(n)
        ]
    )  # fmt: skip


def dpo_config(out: str, *, k: int, batch: int, **overrides: Any) -> Any:
    from trl import DPOConfig

    options: dict[str, Any] = dict(
        per_device_train_batch_size=batch, gradient_accumulation_steps=k, learning_rate=LR,
        optim="sgd", lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0,
        num_train_epochs=1, train_sampling_strategy="sequential", logging_steps=1,
        use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, gradient_checkpointing=False, bf16=False, seed=0, beta=BETA,
    )  # fmt: skip
    options.update(overrides)
    return DPOConfig(out, **options)


def run_dpo(
    n: int, *, k: int, batch: int, exact: bool, ref: bool = True, **overrides: Any
) -> dict[str, Any]:
    """Train on ``pairs(n)``; ``ref=False`` passes no ``ref_model`` (e.g. with
    ``precompute_ref_log_probs=True``: the reference is the initial policy)."""
    from transformers import TrainerCallback
    from trl import DPOTrainer

    from fullbatch.trl import ExactDPOTrainer

    steps: list[dict[str, torch.Tensor]] = []

    class Record(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            steps.append({n: p.detach().clone() for n, p in kw["model"].named_parameters()})

    cls = ExactDPOTrainer if exact else DPOTrainer
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer: Any = cls(
            model=tiny_causal_lm("llama"),
            ref_model=tiny_causal_lm("llama") if ref else None,
            args=dpo_config(tmp, k=k, batch=batch, **overrides),
            train_dataset=pairs(n),
            processing_class=char_tokenizer(),
            callbacks=[Record()],
        )
        recording = Recording(trainer.data_collator)
        trainer.data_collator = recording
        trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {"steps": steps, "logs": logs, "seen": recording.seen}


def _logps(model: Any, prompts: list[list[int]], completions: list[list[int]]) -> tuple:
    """Per sequence: the completion's summed log-probability; per token: (log p, mask)."""
    seqs = [p + c for p, c in zip(prompts, completions, strict=True)]
    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    comp = torch.tensor([[0] * len(p) + [1] * len(c) + [0] * (width - len(p) - len(c))
                         for p, c in zip(prompts, completions, strict=True)])  # fmt: skip
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
    token = F.log_softmax(logits.double(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    mask = comp[:, 1:].bool()
    token = token * mask
    return token.sum(1), token, mask


def dpo_reference(windows_: list[list[dict]], starts: list[dict], weights: tuple) -> dict:
    model, ref_model = tiny_causal_lm("llama"), tiny_causal_lm("llama")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    steps, metrics = [], []
    for rows, start in zip(windows_, starts, strict=True):
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(start[n])
        prompts = [r["prompt_ids"] for r in rows]
        chosen, rejected = [r["chosen_ids"] for r in rows], [r["rejected_ids"] for r in rows]
        pc, token_c, mask_c = _logps(model, prompts, chosen)
        pr, _, _ = _logps(model, prompts, rejected)
        with torch.no_grad():
            rc, _, _ = _logps(ref_model, prompts, chosen)
            rr, _, _ = _logps(ref_model, prompts, rejected)
        delta = (pc - rc) - (pr - rr)
        sigmoid = -F.logsigmoid(BETA * delta).mean()
        sft = -token_c.sum() / mask_c.sum()
        loss = weights[0] * sigmoid + weights[1] * sft
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps.append({n: p.detach().clone() for n, p in model.named_parameters()})
        rewards = BETA * (pc - rc).detach()
        metrics.append(
            {
                "loss": float(loss.detach()),
                "rewards/chosen": float(rewards.mean()),
                "rewards/margins": float((rewards - BETA * (pr - rr).detach()).mean()),
            }
        )
    return {"steps": steps, "metrics": metrics}

"""Stock TRL DPOTrainer (loss_type sigmoid) on a tiny Llama (float32), a frozen copy as the
reference, SGD, gradient_accumulation_steps=2, probed with no --objective (the probe must
judge it under DPO, not guess). Default: 2 pairs per micro-batch (every micro-batch alike);
``--uneven``: 3 pairs in micro-batches of 2 and 1 (TRL averages each over its own pairs).

The truth: the first window's pairs as one float64 batch, the mean over pairs of
``-log σ(β Δ)`` (``Δ``: the chosen minus the rejected completion's summed log-probability
ratio to the frozen initial model), one SGD step. ``bf16=False``: TRL's configs default to
bf16 autocast, whose rounding (~1e-3 on this model; the probe's band measures it) would hide
what the row is about."""

import copy
import sys
import tempfile
import warnings

import torch
import torch.nn.functional as F
from _truth import flat, relative, say
from datasets import Dataset
from trl import DPOConfig, DPOTrainer

from fullbatch._demo._trl_tiny import char_tokenizer, tiny_causal_lm

LR, BETA, K, BATCH = 0.1, 0.1, 2, 2
warnings.simplefilter("ignore")
n = K * BATCH - 1 if "--uneven" in sys.argv else K * BATCH
model = tiny_causal_lm("llama").float()
start = copy.deepcopy(model)
before = flat(model)
pairs = Dataset.from_list(
    [
        {
            "prompt": "ab " * (1 + i % 3),
            "chosen": "cd " * (1 + i % 4) + "x",
            "rejected": "e" * (1 + i % 2),
        }
        for i in range(n)
    ]
)


def logps(m: torch.nn.Module, rows: list[dict], side: str) -> torch.Tensor:
    """Each row's completion log-probability, summed over its tokens, in float64."""
    seqs = [r["prompt_ids"] + r[f"{side}_ids"] for r in rows]
    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    mask = torch.tensor(
        [[0] * len(r["prompt_ids"]) + [1] * len(r[f"{side}_ids"]) + [0] * (width - len(s))
         for r, s in zip(rows, seqs, strict=True)]
    )[:, 1:]  # fmt: skip
    attn = (torch.arange(width)[None] < torch.tensor([len(s) for s in seqs])[:, None]).long()
    logits = m(input_ids=ids, attention_mask=attn).logits[:, :-1].double()
    token = F.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    return (token * mask).sum(1)


with tempfile.TemporaryDirectory() as tmp:
    args = DPOConfig(
        tmp, per_device_train_batch_size=BATCH, gradient_accumulation_steps=K, learning_rate=LR,
        optim="sgd", lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0,
        max_steps=1, beta=BETA, train_sampling_strategy="sequential", report_to=[],
        use_cpu=True, save_strategy="no", disable_tqdm=True, logging_steps=1, bf16=False,
    )  # fmt: skip
    trainer = DPOTrainer(
        model=model, ref_model=copy.deepcopy(model), args=args, train_dataset=pairs,
        processing_class=char_tokenizer(),
    )  # fmt: skip
    rows = [trainer.train_dataset[i] for i in range(min(n, K * BATCH))]
    trainer.train()
update = flat(model) - before
policy, ref = copy.deepcopy(start).double(), copy.deepcopy(start).double()
with torch.no_grad():
    ref_c, ref_r = logps(ref, rows, "chosen"), logps(ref, rows, "rejected")
delta = (logps(policy, rows, "chosen") - ref_c) - (logps(policy, rows, "rejected") - ref_r)
(-F.logsigmoid(BETA * delta)).mean().backward()
say(relative(update, -LR * torch.cat([p.grad.flatten() for p in policy.parameters()])))

"""The Hugging Face Trainer with a DeepSpeed ZeRO-2 config that leaves gradient_clipping out,
and TrainingArguments(max_grad_norm=0.3): one window of 4 micro-batches of 2 rows, 1 rank."""

import os
import socket

sock = socket.socket()
sock.bind(("127.0.0.1", 0))
PORT = sock.getsockname()[1]
sock.close()
os.environ.pop("LOCAL_SIZE", None)  # DeepSpeed's shared-memory all-reduce stays off
os.environ.setdefault(  # the tests' build folder (tests/_dist_ds.py): DeepSpeed's ops built once
    "TORCH_EXTENSIONS_DIR",
    os.path.join(
        os.path.expanduser("~"),
        ".cache",
        "torch_extensions",
        "fullbatch-"
        + __import__("hashlib").sha1(__import__("sys").prefix.encode()).hexdigest()[:10],
    ),
)
os.environ.update(
    DS_ACCELERATOR="cpu",
    RANK="0",
    WORLD_SIZE="1",
    LOCAL_RANK="0",
    LOCAL_WORLD_SIZE="1",
    MASTER_ADDR="127.0.0.1",
    MASTER_PORT=str(PORT),
)

import copy  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _truth import flat, relative, say  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

from fullbatch._demo._trl_tiny import tiny_causal_lm  # noqa: E402

torch.distributed.init_process_group("gloo", rank=0, world_size=1)
model = tiny_causal_lm("llama").float()
start = copy.deepcopy(model)
g = torch.Generator().manual_seed(0)
rows = [
    {"input_ids": torch.randint(3, 60, (5 + (i * 3) % 7,), generator=g).tolist()} for i in range(8)
]


def collate(batch):
    width = max(len(r["input_ids"]) for r in batch)
    ids = torch.tensor([r["input_ids"] + [0] * (width - len(r["input_ids"])) for r in batch])
    return {
        "input_ids": ids,
        "attention_mask": (ids != 0).long(),
        "labels": ids.masked_fill(ids == 0, -100),
    }


config = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "zero_optimization": {"stage": 2},
    "zero_allow_untested_optimizer": True,
    "zero_force_ds_cpu_optimizer": False,
    "steps_per_print": 10**9,
}
before = flat(model)
with tempfile.TemporaryDirectory() as tmp:
    args = TrainingArguments(
        tmp,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4,
        learning_rate=0.1,
        optim="sgd",
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.3,
        max_steps=1,
        train_sampling_strategy="sequential",
        remove_unused_columns=False,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
        deepspeed=config,
    )
    Trainer(model=model, args=args, train_dataset=rows, data_collator=collate).train()
update = flat(model) - before
ref = start.double()
full = collate(rows)
logits = ref(input_ids=full["input_ids"], attention_mask=full["attention_mask"]).logits
F.cross_entropy(logits[:, :-1].flatten(0, 1), full["labels"][:, 1:].flatten()).backward()
norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.3))  # what max_grad_norm asks
asked = -0.1 * torch.cat([p.grad.flatten() for p in ref.parameters()])
say(relative(update, asked), gradient_norm=norm, ratio=float(update.norm() / asked.norm()))

"""TRL's SFTTrainer on a tiny GPT-2 built from a config, at TRL's default bf16 (--fp32: float32;
--exact: fullbatch.trl.ExactSFTTrainer, the right form). Clipping off: at its default 1.0 it
clips these first steps and so rescales each whole update."""

import sys
import tempfile
import warnings

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

if "--exact" in sys.argv:
    from fullbatch.trl import ExactSFTTrainer as SFTTrainer

warnings.filterwarnings("ignore")
torch.manual_seed(0)
chars = "abcdefghijklmnopqrstuvwxyz ."
vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")
config = GPT2Config(
    vocab_size=len(vocab),
    n_positions=256,
    n_embd=32,
    n_layer=2,
    n_head=2,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
)
model = GPT2LMHeadModel(config)
words = "the quick brown fox jumps over a lazy dog and runs far away".split()
texts = [
    " ".join((words * 4)[i % 7 : i % 7 + 20 + (5 * i) % 9]) + "." for i in range(32)
]  # ~140 chars
args = SFTConfig(
    tempfile.mkdtemp(),
    per_device_train_batch_size=2,
    gradient_accumulation_steps=4,
    max_steps=3,
    bf16="--fp32" not in sys.argv,
    use_cpu=True,
    report_to=[],
    save_strategy="no",
    disable_tqdm=True,
    logging_steps=100,
    learning_rate=1e-3,
    dataloader_drop_last=True,
    max_grad_norm=0.0,
)
trainer = SFTTrainer(
    model=model,
    args=args,
    train_dataset=Dataset.from_dict({"text": texts}),
    processing_class=tokenizer,
)
trainer.train()

"""Stock TRL DPOTrainer (loss_type sigmoid) on a tiny Llama, a frozen copy as the reference,
gradient_accumulation_steps=2: probed with no --objective (the probe must not guess)."""

import copy
import tempfile
import warnings

from _truth import flat, say
from datasets import Dataset
from trl import DPOConfig, DPOTrainer

from fullbatch._demo._trl_tiny import char_tokenizer, tiny_causal_lm

warnings.simplefilter("ignore")
model = tiny_causal_lm("llama").float()
before = flat(model)
pairs = Dataset.from_list(
    [
        {
            "prompt": "ab " * (1 + i % 3),
            "chosen": "cd " * (1 + i % 4) + "x",
            "rejected": "e" * (1 + i % 2),
        }
        for i in range(4)
    ]
)
with tempfile.TemporaryDirectory() as tmp:
    args = DPOConfig(
        tmp,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=2,
        learning_rate=1e-2,
        max_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
    )
    trainer = DPOTrainer(
        model=model,
        ref_model=copy.deepcopy(model),
        args=args,
        train_dataset=pairs,
        processing_class=char_tokenizer(),
    )
    trainer.train()
say(None, why="trained", moved=float((flat(model) - before).norm()))

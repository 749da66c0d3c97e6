"""A tiny Mixtral (float64, router_aux_loss_coef 0.25, output_router_logits) trained one window
of 6 right-padded rows in 3 micro-batches, as users train it:

- default: the stock loop, ``model(**micro).loss / 3`` (each micro-batch's own aux loss);
- ``--trainer``: the stock Hugging Face Trainer (``num_items_in_batch``: the cross-entropy
  exact, each micro-batch's aux loss added undivided);
- ``--exact``: ``fullbatch.hf.ExactTrainer(loss="causal_lm")`` (the window's routing counts).

The truth: the model's own loss on the window's 6 rows as one batch (transformers'
cross-entropy plus ``router_aux_loss_coef`` times its ``load_balancing_loss_func``), float64.
"""

import contextlib
import copy
import io
import sys
import tempfile

import torch
import transformers
from _truth import flat, relative, say

mode = sys.argv[1] if len(sys.argv) > 1 else "--loop"
torch.manual_seed(0)
config = transformers.MixtralConfig(
    vocab_size=48, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
    router_aux_loss_coef=0.25, output_router_logits=True, experts_implementation="eager",
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
model = transformers.MixtralForCausalLM(config).double()
start = copy.deepcopy(model)
ids = torch.randint(3, 48, (6, 7), generator=torch.Generator().manual_seed(1))
mask = torch.ones(6, 7, dtype=torch.long)
for row, length in enumerate((7, 3, 5, 7, 2, 6)):
    mask[row, length:] = 0
rows = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
before = flat(model)
if mode == "--loop":
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    for a, b in [(0, 1), (1, 4), (4, 6)]:
        (model(**{k: v[a:b] for k, v in rows.items()}).loss / 3).backward()
    opt.step()
else:
    from fullbatch.hf import ExactTrainer

    args = transformers.TrainingArguments(
        tempfile.mkdtemp(), per_device_train_batch_size=2, gradient_accumulation_steps=3,
        max_steps=1, learning_rate=1.0, lr_scheduler_type="constant", max_grad_norm=0.0,
        use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    data = [{k: v[i] for k, v in rows.items()} for i in range(6)]
    kwargs = dict(
        model=model, args=args, train_dataset=data,
        data_collator=lambda b: {k: torch.stack([r[k] for r in b]) for k in b[0]},
        optimizers=(torch.optim.SGD(model.parameters(), lr=1.0), None),
    )  # fmt: skip
    trainer = ExactTrainer(**kwargs, loss="causal_lm") if mode == "--exact" else None
    trainer = trainer or transformers.Trainer(**kwargs)
    with contextlib.redirect_stdout(io.StringIO()):  # the Trainer's log lines
        trainer.train()
update = flat(model) - before
start(**rows).loss.backward()
say(relative(update, -torch.cat([p.grad.flatten() for p in start.parameters()])))

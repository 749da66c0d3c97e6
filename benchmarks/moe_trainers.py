"""The Hugging Face and TRL wings on a tiny MoE model: one step against the float64 full batch.

Tiny random Mixtral, Qwen3-MoE and OLMoE (``tests/_moe_cases.py``: float64, 2 layers, 4
experts, top-2, ``router_aux_loss_coef`` 0.25), one window of 8 right-padded rows with 1 to 7
real tokens as 4 micro-batches of 2 rows, one process. The reference is written here: one
forward of the whole window, the token-mean cross-entropy plus ``coef`` times the pooled
load-balancing loss of the whole window (transformers' definition, in float64). Each row is
one optimizer step (SGD, lr 1, no clipping) of a trainer: its applied gradient's error
``‖g - g*‖ / ‖g*‖``. ``trl.SFTTrainer`` with the 8 rows in one micro-batch is TRL's own full
batch: its distance to the reference is the float32 inside TRL's fused LM head; the step
without the aux term shows how much of the step the aux term is.

Run: ``PYTHONPATH=src python benchmarks/moe_trainers.py`` (about a minute of CPU time).
"""

from __future__ import annotations

import contextlib
import copy
import io
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _moe_cases import (
    COEF,
    FAMILIES,
    VOCAB,
    aux64,
    forward,
    make_moe,
    moe_rows,
    rel_err,
    trainer_step,
)
from _trl_moe_cases import sft_step

LENGTHS = (7, 3, 5, 7, 2, 6, 4, 1)


def reference(model: Any) -> list[torch.Tensor]:
    """The full batch's gradient: CE summed over the window's targets plus ``n · coef · aux``,
    backpropagated once, divided by the ``n`` targets."""
    rows = moe_rows(LENGTHS, seed=1)
    out = forward(model, rows)
    labels = rows["labels"][:, 1:]
    n = int((labels != -100).sum())
    logits = out.logits[:, :-1].reshape(-1, VOCAB)
    ce = F.cross_entropy(logits, labels.reshape(-1), ignore_index=-100, reduction="sum")
    (ce + n * COEF * aux64(out.router_logits, rows["attention_mask"])).backward()
    return [torch.zeros_like(p) if p.grad is None else p.grad / n for p in model.parameters()]


def steps(family: str) -> dict[str, list[torch.Tensor]]:
    import transformers
    from trl import SFTTrainer

    import fullbatch.hf
    import fullbatch.trl

    out: dict[str, list[torch.Tensor]] = {}
    hf = make_moe(family)
    hf.config.output_router_logits = True  # the model adds coef · aux to its own loss
    with tempfile.TemporaryDirectory() as tmp:
        out["Trainer (stock)"] = trainer_step(copy.deepcopy(hf), transformers.Trainer, tmp, LENGTHS)
        out["ExactTrainer"] = trainer_step(
            copy.deepcopy(hf), fullbatch.hf.ExactTrainer, tmp, LENGTHS, loss="causal_lm"
        )
        # TRL turns output_router_logits on itself for the model's coef
        out["SFTTrainer, 1 micro-batch (TRL's full batch)"] = sft_step(
            make_moe(family), SFTTrainer, tmp, LENGTHS, 1, batch=8
        )[0]
        out["SFTTrainer (stock)"] = sft_step(make_moe(family), SFTTrainer, tmp, LENGTHS, 4)[0]
        out["ExactSFTTrainer"] = sft_step(
            make_moe(family), fullbatch.trl.ExactSFTTrainer, tmp, LENGTHS, 4
        )[0]
        out["ExactSFTTrainer, router_aux_loss_coef=0 (no aux term)"] = sft_step(
            make_moe(family),
            fullbatch.trl.ExactSFTTrainer,
            tmp,
            LENGTHS,
            4,
            router_aux_loss_coef=0.0,
        )[0]
    return out


def main() -> None:
    print("| model | trainer | step grad error |")
    print("|---|---|---|")
    for family in FAMILIES:
        want = reference(make_moe(family))
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            got = steps(family)
        for name, grads in got.items():
            print(f"| {family} | {name} | {rel_err(grads, want):.1e} |")


if __name__ == "__main__":
    main()

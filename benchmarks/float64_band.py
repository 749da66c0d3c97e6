"""How close "float64" gets for Hugging Face models that compute parts in float32.

fullbatch's float64 promise (~1e-12 relative) holds for models that compute in float64. Some
Hugging Face models keep parts in float32 even in a float64 model (Llama's RMSNorm and rotary
embeddings): the full batch itself then moves by float32 rounding when its loss is merely
normalized after backward instead of before. This script prints that rounding band (measured
by ``fb.verify``) and fullbatch's error, per model, all float64, from configs (random init):

    python benchmarks/float64_band.py
"""

from __future__ import annotations

import torch
import transformers

import fullbatch as fb


def batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    lengths = (12, 5, 9, 3, 11, 7)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(1, 64, (n,), generator=g)
        mask[row, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def loss(
    model: torch.nn.Module, micro: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    out = model(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"])
    return fb.causal_lm_loss(out.logits, micro["labels"])


MODELS = {
    "GPT-2": lambda: transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=64,
            n_positions=32,
            n_embd=16,
            n_layer=2,
            n_head=2,
            bos_token_id=0,
            eos_token_id=0,
        )
    ),
    "Llama": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=32,
        )
    ),
}


def main() -> None:
    print(
        "| model (float64) | rounding band of the full batch | fullbatch's grad error | verdict |"
    )
    print("|---|---|---|---|")
    for name, make in MODELS.items():
        torch.manual_seed(0)
        model = make().double()
        report = fb.verify(model, batch(), loss, micro_batch_size=2)
        verdict = "PASSED" if report.passed else "FAILED"
        print(
            f"| {name} | {report.rounding_band:.1e} | {report.fullbatch.max_rel_error:.1e} | "
            f"{verdict} (tolerance {report.tolerance:.1e}) |"
        )


if __name__ == "__main__":
    main()

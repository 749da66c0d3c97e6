"""Where padding-free packing goes wrong, measured: the gradient of packed micro-batches against
the same rows padded, per model and per way of calling it, and what ``fb.verify`` says.

    python benchmarks/packing_pitfalls.py

Tiny transformers models built from configs (2 layers, hidden 32, float64, dropout off), one
batch of 10 rows of 2-24 tokens packed into micro-batches of at most 40 real tokens. Each cell
is ``fb.verify(model, batch, loss_fn, micro_batch_tokens=40, pack=True)``: the gradient error
``||g_packed - g_padded|| / ||g_padded||`` and the verdict with its named cause. The calls:

- documented: ``model(**{k: v for k, v in micro.items() if k != "labels"})`` (the micro-batch
  holds ``position_ids``, ``cu_seq_lens_q/k``, ``max_length_q/k`` and ``use_cache=False``);
- cache left on: ``model(input_ids=..., position_ids=...)``, as a hand-written loop writes it;
- 2-D mask: the documented call plus an all-ones ``attention_mask``;
- no position_ids: ``model(input_ids=..., use_cache=False)``.
"""

from __future__ import annotations

import warnings

import torch
import transformers

import fullbatch as fb

VOCAB, WIDTH, TOKENS = 64, 24, 40
LENGTHS = [12, 5, 20, 3, 17, 9, 24, 7, 14, 2]


def model(kind: str) -> torch.nn.Module:
    small = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    heads = {"num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
    if kind == "Llama":
        config, cls = transformers.LlamaConfig(**small, **heads), transformers.LlamaForCausalLM
    elif kind == "Qwen2":
        config, cls = transformers.Qwen2Config(**small, **heads), transformers.Qwen2ForCausalLM
    elif kind == "Mistral (window 6)":
        config = transformers.MistralConfig(sliding_window=6, **small, **heads)
        cls = transformers.MistralForCausalLM
    elif kind == "GPT-2":
        config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64)
        config.bos_token_id = config.eos_token_id = 1
        cls = transformers.GPT2LMHeadModel
    else:
        config = transformers.BertConfig(max_position_embeddings=64, num_attention_heads=4, **small)
        cls = transformers.BertForMaskedLM
    config.vocab_size = VOCAB
    torch.manual_seed(0)
    return cls(config).double().train()


def batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor(LENGTHS)
    mask = (torch.arange(WIDTH) < lengths[:, None]).long()
    ids = torch.randint(3, VOCAB, (len(LENGTHS), WIDTH), generator=g) * mask
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def loss(net: torch.nn.Module, micro: dict, **call: torch.Tensor | bool) -> tuple:
    logits = net(**call).logits
    labels = micro["labels"]
    if isinstance(net, transformers.BertForMaskedLM):  # masked LM: no shift
        total = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), reduction="sum"
        )
        return total, (labels != -100).sum()
    return fb.causal_lm_loss(logits, labels)


def documented(net: torch.nn.Module, micro: dict) -> tuple:
    return loss(net, micro, **{k: v for k, v in micro.items() if k != "labels"})


def cache_left_on(net: torch.nn.Module, micro: dict) -> tuple:
    return loss(net, micro, input_ids=micro["input_ids"], position_ids=micro["position_ids"])


def mask_2d(net: torch.nn.Module, micro: dict) -> tuple:
    call = {k: v for k, v in micro.items() if k != "labels"}
    call.setdefault("attention_mask", torch.ones_like(micro["input_ids"]))
    return loss(net, micro, **call)


def no_position_ids(net: torch.nn.Module, micro: dict) -> tuple:
    call = {"input_ids": micro["input_ids"], "use_cache": False}
    if "attention_mask" in micro:  # the padded arm keeps its mask
        call["attention_mask"] = micro["attention_mask"]
    return loss(net, micro, **call)


def main() -> None:
    warnings.simplefilter("ignore")
    calls = {
        "documented": documented,
        "cache left on": cache_left_on,
        "2-D mask": mask_2d,
        "no position_ids": no_position_ids,
    }
    kinds = ["Llama", "Qwen2", "Mistral (window 6)", "GPT-2", "BERT"]
    print(
        f"{len(LENGTHS)} rows of {min(LENGTHS)}-{max(LENGTHS)} tokens, micro_batch_tokens="
        f"{TOKENS}, float64, transformers {transformers.__version__}, torch {torch.__version__}"
    )
    print(f"{'model':20s}" + "".join(f"{name:>18s}" for name in calls))
    causes: dict[str, str] = {}
    for kind in kinds:
        net = model(kind)
        cells = []
        for name, fn in calls.items():
            report = fb.verify(net, batch(), fn, micro_batch_tokens=TOKENS, pack=True)
            verdict = "ok" if report.passed else "FAIL"
            cells.append(f"{report.grad_error:9.1e} {verdict:>4s}")
            if not report.passed:
                causes.setdefault(report.causes[0].split(":")[0], f"{kind}, {name}")
        print(f"{kind:20s}" + "".join(f"{c:>18s}" for c in cells))
    print("\ngradient error ||g_packed - g_padded|| / ||g_padded||; causes named by fb.verify:")
    for cause, first in causes.items():
        print(f"  {cause}  (first seen: {first})")


if __name__ == "__main__":
    main()

"""Tiny Hugging Face models and a character tokenizer, built in code, for TRL examples.

Public as ``fullbatch.testing.tiny_causal_lm``, ``tiny_seq2seq`` and ``char_tokenizer``; used
by ``docs/integrations_trl.md``, ``benchmarks/integration_trl.py`` and the tests: no
download, seeded, float64 by default (so an error above the float32 band inside some heads is
the accumulation's, not rounding's).

>>> tok = char_tokenizer()
>>> tok("ab")["input_ids"], len(tok) < 128
([69, 70], True)
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["CHAT_TEMPLATE", "char_tokenizer", "has_gemma4", "tiny_causal_lm", "tiny_seq2seq"]

#: A chat template whose assistant turns are marked for TRL's ``assistant_only_loss``.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<' }}{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
    "{% else %}{{ '>' + message['content'] }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<' }}{% endif %}"
)


def _dtype_kwargs(dtype: torch.dtype) -> dict[str, torch.dtype]:
    """``from_config``'s dtype argument: ``dtype=`` from transformers 4.56, ``torch_dtype=``
    before (4.53.3, the declared floor, rejects ``dtype=``)."""
    import transformers

    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


def has_gemma4() -> bool:
    """Whether this transformers knows Gemma 4 (transformers 5; not 4.53.3)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return "gemma4" in CONFIG_MAPPING_NAMES


def char_tokenizer() -> Any:
    """A ``PreTrainedTokenizerFast``: one token per printable ASCII character, 99 ids."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({chr(c): len(specials) + i for i, c in enumerate(range(32, 127))})
    model = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok = PreTrainedTokenizerFast(
        tokenizer_object=model,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_causal_lm(kind: str, *, seed: int = 0, dtype: torch.dtype = torch.float64) -> Any:
    """A 2-layer causal LM (hidden 32, vocab 100): ``"llama"``, ``"gemma4"`` (the
    ``Gemma4ForConditionalGeneration`` that ``AutoModelForCausalLM`` builds; it drops
    ``num_items_in_batch``) or ``"gpt2"``. Dropout is off."""
    from transformers import AutoConfig, AutoModelForCausalLM

    common: dict[str, Any] = dict(vocab_size=100, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    if kind == "llama":
        config = AutoConfig.for_model(
            "llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256, **common,
        )  # fmt: skip
    elif kind == "gemma4":
        if not has_gemma4():
            import transformers

            raise ValueError(
                f"kind='gemma4' needs a transformers with Gemma 4 (5.x), found "
                f"{transformers.__version__}; use 'llama' or 'gpt2'."
            )
        text = dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, layer_types=["sliding_attention", "full_attention"],
            per_layer_config={}, hidden_size_per_layer_input=0, vocab_size_per_layer_input=100,
            sliding_window=16, max_position_embeddings=256, **common,
        )  # fmt: skip
        config = AutoConfig.for_model("gemma4", text_config=text, vision_config=None,
                                      audio_config=None)  # fmt: skip
    elif kind == "gpt2":
        config = AutoConfig.for_model(
            "gpt2", n_embd=32, n_layer=2, n_head=2, n_positions=256, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, **common,
        )  # fmt: skip
    else:
        raise ValueError(f"kind={kind!r}: use 'llama', 'gemma4' or 'gpt2'.")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, **_dtype_kwargs(dtype))
    return model.train()


def tiny_seq2seq(kind: str, *, seed: int = 0, dtype: torch.dtype = torch.float64) -> Any:
    """A 2-layer encoder-decoder (hidden 32, vocab 100): ``"t5"`` or ``"bart"``, dropout off."""
    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    common: dict[str, Any] = dict(vocab_size=100, pad_token_id=0, eos_token_id=1)
    if kind == "t5":
        config = AutoConfig.for_model(
            "t5", d_model=32, d_ff=64, d_kv=16, num_layers=2, num_heads=2, dropout_rate=0.0,
            decoder_start_token_id=0, **common,
        )  # fmt: skip
    elif kind == "bart":
        config = AutoConfig.for_model(
            "bart", d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, dropout=0.0,
            attention_dropout=0.0, activation_dropout=0.0, max_position_embeddings=256,
            decoder_start_token_id=2, bos_token_id=2, forced_eos_token_id=None, **common,
        )  # fmt: skip
    else:
        raise ValueError(f"kind={kind!r}: use 't5' or 'bart'.")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForSeq2SeqLM.from_config(config, **_dtype_kwargs(dtype))
    return model.train()

"""Packing on transformers models built tiny from configs (float64): every packed step equals
the plain full batch on Llama, Qwen2, Mistral (sliding window shorter than a row) and GPT-2;
the packing check (``fb.verify(..., pack=True)`` and ``window.run``'s first window) passes
there and fails with its named cause on a loss that leaves the cache on, a 2-D mask, a 4-D
block mask on Mistral, BERT and a model without ``position_ids``."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F

import fullbatch as fb
from conftest import IGNORE

transformers = pytest.importorskip("transformers")

# transformers 4.53.3 (the floor): GPT-2 lets attention cross packed rows and BERT's forward
# takes no packed-sequence keys, so the packing check refuses them (measured there: GPT-2 leak
# 3.1e-02, gradient error 9.1e-02; BERT: TypeError on cu_seq_lens_q). Correct refusals, but
# these cases test the packed forms of transformers 5.
NEW_PACKING = int(transformers.__version__.split(".")[0]) >= 5
new_packing = pytest.mark.skipif(
    not NEW_PACKING, reason="GPT-2/BERT packing needs transformers 5 (refused on 4.53.3)"
)

VOCAB, WIDTH = 64, 24
LENGTHS = [12, 5, 20, 3, 17, 9, 24, 7, 14, 2]
TOKENS = 40


def tiny(kind: str) -> torch.nn.Module:
    small = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2}
    heads = {"num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64}
    if kind == "llama":
        config = transformers.LlamaConfig(vocab_size=VOCAB, **small, **heads)
        cls = transformers.LlamaForCausalLM
    elif kind == "qwen2":
        config = transformers.Qwen2Config(vocab_size=VOCAB, **small, **heads)
        cls = transformers.Qwen2ForCausalLM
    elif kind == "mistral":  # a sliding window shorter than most rows
        config = transformers.MistralConfig(vocab_size=VOCAB, sliding_window=6, **small, **heads)
        cls = transformers.MistralForCausalLM
    elif kind == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=64,
            bos_token_id=1, eos_token_id=2, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0,
        )  # fmt: skip
        cls = transformers.GPT2LMHeadModel
    else:
        config = transformers.BertConfig(
            vocab_size=VOCAB, max_position_embeddings=64, num_attention_heads=2, **small
        )
        cls = transformers.BertForMaskedLM
    torch.manual_seed(0)
    model = cls(config).double()
    model.train()
    return model


def window(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(LENGTHS)[torch.randperm(len(LENGTHS), generator=g)]
    mask = (torch.arange(WIDTH) < lengths[:, None]).long()
    ids = torch.randint(3, VOCAB, (len(LENGTHS), WIDTH), generator=g) * mask
    labels = ids.masked_fill(mask == 0, IGNORE)
    labels[torch.rand(labels.shape, generator=g) < 0.2] = IGNORE
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def packed_loss(model, micro):
    """The documented form: every key but the labels goes to the model."""
    logits = model(**{k: v for k, v in micro.items() if k != "labels"}).logits
    return fb.causal_lm_loss(logits, micro["labels"])


def cache_left_on(model, micro):
    """A hand-written call that forgets use_cache=False."""
    out = model(input_ids=micro["input_ids"], position_ids=micro["position_ids"])
    return fb.causal_lm_loss(out.logits, micro["labels"])


def with_2d_mask(model, micro):
    ids = micro["input_ids"]
    mask = micro.get("attention_mask", torch.ones_like(ids))
    out = model(input_ids=ids, attention_mask=mask, position_ids=micro["position_ids"],
                use_cache=False)  # fmt: skip
    return fb.causal_lm_loss(out.logits, micro["labels"])


def with_block_mask(model, micro):
    """A hand-built 4-D block-diagonal causal mask: it knows nothing of a sliding window."""
    ids = micro["input_ids"]
    if "cu_seq_lens_q" not in micro:
        return with_2d_mask(model, micro)
    n = ids.shape[1]
    sizes = (micro["cu_seq_lens_q"][1:] - micro["cu_seq_lens_q"][:-1]).long()
    row = torch.repeat_interleave(torch.arange(len(sizes)), sizes)
    allowed = (row[:, None] == row[None]) & torch.ones(n, n, dtype=torch.bool).tril()
    mask = torch.zeros(1, 1, n, n, dtype=torch.float64).masked_fill(~allowed, float("-inf"))
    out = model(input_ids=ids, attention_mask=mask, position_ids=micro["position_ids"],
                use_cache=False)  # fmt: skip
    return fb.causal_lm_loss(out.logits, micro["labels"])


def mlm_loss(model, micro):
    logits = model(**{k: v for k, v in micro.items() if k != "labels"}).logits
    labels = micro["labels"]
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    return loss, (labels != IGNORE).sum()


def reference(model, batches, lr):
    """Plain PyTorch, float64: the whole padded window, mean loss, one backward, SGD."""
    out = []
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for batch in batches:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append([p.detach().clone() for p in model.parameters()])
    return out


def fullbatch_run(kind: str, batches: list, **options) -> tuple[list, object]:
    model = tiny(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    out = []
    with fb.Accumulator(model, opt, micro_batch_tokens=TOKENS, **options) as acc:
        for win in acc.windows(batches):
            stats = win.run(lambda micro: packed_loss(model, micro))
            if options.get("pack"):
                assert stats.micro_batches == 3  # 113 real tokens in bins of at most 40
            out.append([p.detach().clone() for p in model.parameters()])
    return out, acc


def worst(got: list, want: list) -> float:
    return max(
        float((g - r).abs().max() / r.abs().max())
        for a, b in zip(got, want, strict=True)
        for g, r in zip(a, b, strict=True)
    )


@pytest.mark.parametrize(
    "kind", ["llama", "qwen2", "mistral", pytest.param("gpt2", marks=new_packing)]
)
def test_packed_steps_equal_the_full_batch(kind: str) -> None:
    """Two float64 steps. The plain reference differs from any fullbatch run by the model's
    float32 internals (RMSNorm upcasts to float32; fullbatch scales the loss by a power of two
    before backward): that band is measured on the sorted, unpacked run."""
    batches = [window(seed) for seed in range(2)]
    want = reference(tiny(kind), batches, lr=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the documented form warns about nothing
        got, acc = fullbatch_run(kind, batches, pack=True)
        unpacked, _ = fullbatch_run(kind, batches)
    band = worst(unpacked, want)
    assert worst(got, want) <= 2 * band + 1e-12, (worst(got, want), band)
    assert worst(got, unpacked) < 1e-10  # same loss scale: only the packing differs
    report = acc._engine.pack_check.report
    assert report.passed and report.leak == 0.0 and report.grad_error <= report.tolerance


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_packed_rows_rounded_up_equal_the_full_batch(kind: str) -> None:
    """pad_to_multiple_of=8: each packed row ends in a padding sequence of its own; the
    packing check passes on it (window.run), and the plain loop's check too."""
    batches = [window(seed) for seed in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got, acc = fullbatch_run(kind, batches, pack=True, pad_to_multiple_of=8)
        exact, _ = fullbatch_run(kind, batches, pack=True)
    assert worst(got, exact) < 1e-10
    report = acc._engine.pack_check.report
    assert report.passed and report.leak == 0.0
    model = tiny(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the plain loop's check passes silently
        with fb.Accumulator(
            model, opt, micro_batch_tokens=TOKENS, pack=True, pad_to_multiple_of=8
        ) as loop:
            for win in loop.windows(batches):
                for micro in win:
                    assert micro["input_ids"].shape[1] % 8 == 0
                    win.backward(*packed_loss(model, micro))
                win.step()
    assert not loop._engine.pack_check.pending
    assert worst([[p.detach() for p in model.parameters()]], got[-1:]) < 1e-10


@pytest.mark.parametrize("kind", ["llama", pytest.param("gpt2", marks=new_packing)])
def test_verify_passes_the_documented_form(kind: str) -> None:
    model = tiny(kind)
    before = [p.detach().clone() for p in model.parameters()]
    report = fb.verify(model, window(0), packed_loss, micro_batch_tokens=TOKENS, pack=True)
    assert report.passed, str(report)
    assert report.leak == 0.0 and report.band > 0 and "PASSED" in str(report)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters()) and model.training


@pytest.mark.parametrize(
    ("kind", "loss_fn", "cause"),
    [
        ("llama", cache_left_on, "cache left on"),
        ("qwen2", cache_left_on, "cache left on"),
        ("gpt2", cache_left_on, "cache left on"),
        ("llama", with_2d_mask, "a 2-D attention_mask was passed"),
        ("mistral", with_block_mask, "4-D attention_mask .* drops the sliding window"),
        pytest.param("bert", mlm_loss, "an encoder that ignores position_ids", marks=new_packing),
    ],
    ids=lambda v: getattr(v, "__name__", v),
)
def test_verify_fails_with_its_named_cause(kind, loss_fn, cause) -> None:
    report = fb.verify(tiny(kind), window(0), loss_fn, micro_batch_tokens=TOKENS, pack=True)
    assert not report.passed
    assert report.grad_error > 100 * report.tolerance, str(report)
    # the block mask keeps rows apart but drops the window inside a row: no leak, wrong gradient
    assert report.leak is not None and (report.leak > 0) == (loss_fn is not with_block_mask)
    assert len(report.causes) == 1
    assert re.search(cause, report.causes[0]), report.causes
    assert "FAILED" in str(report)


def test_verify_names_a_model_without_position_ids() -> None:
    class NoPositions(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.out = torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB)

        def forward(self, input_ids):
            return self.out(self.embed(input_ids))

    def loss_fn(model, micro):
        return fb.causal_lm_loss(model(**{k: v for k, v in micro.items() if k != "labels"}),
                                 micro["labels"])  # fmt: skip

    report = fb.verify(NoPositions().double(), window(0), loss_fn, micro_batch_tokens=TOKENS,
                       pack=True)  # fmt: skip
    assert not report.passed and "a model without position_ids" in report.causes[0]


@pytest.mark.filterwarnings("ignore:a row of")
def test_verify_refuses_a_check_that_cannot_fail_and_bad_arguments() -> None:
    model = tiny("llama")
    with pytest.raises(ValueError, match="every packed micro-batch of micro_batch_tokens=2"):
        fb.verify(model, window(0), packed_loss, micro_batch_tokens=2, pack=True)
    with pytest.raises(ValueError, match=r"pack=True and micro_batch_tokens=T .* got pack=False"):
        fb.verify(model, window(0), packed_loss, micro_batch_tokens=TOKENS)
    with pytest.raises(ValueError, match="micro_batch_size=4"):
        fb.verify(model, window(0), packed_loss, micro_batch_size=4, pack=True)
    with pytest.raises(ValueError, match="needs micro_batch_tokens=T"):
        fb.verify(model, window(0), packed_loss, micro_batch_tokens=None, pack=True)


def _state(model, opt):
    return [p.detach().clone() for p in model.parameters()], dict(opt.state)


def test_window_run_refuses_before_anything_changes() -> None:
    model = tiny("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    with fb.Accumulator(model, opt, micro_batch_tokens=TOKENS, pack=True) as acc:
        windows = acc.windows([window(0), window(1)])
        win = next(windows)
        with pytest.raises(
            ValueError, match=r"(?s)does not respect the row boundaries.*cache left"
        ):
            win.run(lambda micro: cache_left_on(model, micro))
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
        assert all(p.grad is None for p in model.parameters()) and not opt.state
        assert torch.equal(rng, torch.get_rng_state()) and acc.steps == 0
        assert model.training and model.model.layers[0].self_attn.attention_dropout == 0.0


def test_opting_out_skips_the_check_and_trains_wrong() -> None:
    """verify_pack=False: no check, and the loss that leaves the cache on is really wrong."""
    batches = [window(0)]
    want = reference(tiny("llama"), batches, lr=0.5)[0]
    model = tiny("llama")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with fb.Accumulator(model, opt, micro_batch_tokens=TOKENS, pack=True, verify_pack=False) as a:
        for win in a.windows(batches):
            win.run(lambda micro: cache_left_on(model, micro))
    err = max(float((p.detach() - r).abs().max() / r.abs().max())
              for p, r in zip(model.parameters(), want, strict=True))  # fmt: skip
    assert err > 1e-3

"""``fullbatch verify --pack --micro-batch-tokens T``: passes on a Llama factory with the
default packed loss, exits 1 naming the cause on a loss that leaves the cache on, and refuses
inconsistent options with one line."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from fullbatch.cli import main

transformers = pytest.importorskip("transformers")

_MODELS = textwrap.dedent(
    """
    import torch
    import transformers

    import fullbatch as fb


    def make():
        config = transformers.LlamaConfig(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
        )
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config)


    def cache_on():
        def loss_fn(model, micro):
            out = model(input_ids=micro["input_ids"], position_ids=micro["position_ids"])
            return fb.causal_lm_loss(out.logits, micro["labels"])

        return make(), loss_fn
    """
)


@pytest.fixture
def files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    (tmp_path / "pack_cli_models.py").write_text(_MODELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = [list(range(3, 3 + n)) for n in (7, 2, 4, 6, 3, 9)]
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return "pack_cli_models", str(data)


def test_pack_passes_with_the_default_loss(capsys, files) -> None:
    module, data = files
    code = main(["verify", "--model", f"{module}:make", "--data", data, "--pack",
                 "--micro-batch-tokens", "12", "--dtype", "float64"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "packing check: PASSED" in out and "leak across rows: 0.0e+00" in out


def test_pack_fails_naming_the_cache(capsys, files) -> None:
    module, data = files
    code = main(["verify", "--model", f"{module}:cache_on", "--data", data, "--pack",
                 "--micro-batch-tokens", "12", "--dtype", "float64"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 1
    assert "packing check: FAILED" in out and "likely cause: cache left on" in out


@pytest.mark.parametrize(
    "extra",
    [["--pack"], ["--micro-batch-tokens", "8"], ["--pack", "--micro-batch-tokens", "8",
                                                  "--micro-batch-size", "2"], []],
)  # fmt: skip
def test_inconsistent_options_are_one_line(capsys, files, extra) -> None:
    module, data = files
    code = main(["verify", "--model", f"{module}:make", "--data", data, *extra])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "give --micro-batch-size M (fullbatch's accumulation), or --pack with" in err

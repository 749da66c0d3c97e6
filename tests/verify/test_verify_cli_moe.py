"""``fullbatch verify --moe``: the MoE load-balancing loss's accumulation choices measured on a
model from the command line (``fb.verify(..., moe=True)``), and the options it refuses."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from fullbatch.cli import main

pytest.importorskip("transformers")

_MODELS = textwrap.dedent(
    """
    import torch
    import transformers


    def mixtral():
        config = transformers.MixtralConfig(
            vocab_size=48, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
            num_experts_per_tok=2, router_aux_loss_coef=0.25, max_position_embeddings=32,
            experts_implementation="eager",
        )
        torch.manual_seed(0)
        return transformers.MixtralForCausalLM(config)


    def with_loss():
        return mixtral(), lambda model, micro: (None, 1)


    def llama():
        config = transformers.LlamaConfig(
            vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
        )
        return transformers.LlamaForCausalLM(config)
    """
)
_ROWS = [[1, 2, 3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13], [14, 15, 16, 17, 18, 19], [20, 21, 22]]


@pytest.fixture
def files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "verify_moe_models.py").write_text(_MODELS)
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in _ROWS) + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _run(capsys: pytest.CaptureFixture[str], files: Path, *args: str) -> tuple[int, str, str]:
    data = str(files / "rows.jsonl")
    code = main(["verify", "--data", data, "--micro-batch-size", "2", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_moe_reports_each_choice(capsys: pytest.CaptureFixture[str], files: Path) -> None:
    code, out, err = _run(capsys, files, "--model", "verify_moe_models:mixtral", "--moe")
    assert code == 0, (out, err)
    assert "PASSED" in out.splitlines()[0], out
    for choice in ("exact (window.stats)", "running mean", "per micro-batch (stock)"):
        assert choice in out, out


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("verify_moe_models:mixtral", "--autocast", "bfloat16"), "drop --pack and --autocast"),
        (("verify_moe_models:with_loss",), "--moe checks the model's own loss"),
        (("verify_moe_models:llama",), "num_experts_per_tok and router_aux_loss_coef"),
    ],
)
def test_moe_refuses(
    capsys: pytest.CaptureFixture[str], files: Path, args: tuple[str, ...], match: str
) -> None:
    code, out, err = _run(capsys, files, "--model", *args, "--moe")
    assert code == 2 and "Traceback" not in err, (code, out, err)
    assert err.startswith("fullbatch verify: error: ") and match in err, err

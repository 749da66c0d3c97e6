"""``fullbatch verify`` on the command line: model sources, data formats, exit codes, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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


    def make(vocab_size=300):
        config = transformers.LlamaConfig(
            vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
        )
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config)


    def make_small_vocab():
        return make(vocab_size=32)


    def make_with_mean_loss():
        def mean_loss(model, micro):
            logits = model(input_ids=micro["input_ids"]).logits
            loss_sum, count = fb.causal_lm_loss(logits, micro["labels"])
            return loss_sum / count, count  # a mean: does not add over micro-batches

        return make(), mean_loss


    class NoLogits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(300, 4)

        def forward(self, input_ids):
            return {"hidden": self.embed(input_ids)}


    def no_logits():
        return NoLogits()


    def broken():
        raise RuntimeError("weights not found")


    not_callable = 3
    """
)

_ROWS = [[1, 2, 3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13], [14, 15, 16, 17, 18, 19], [20, 21, 22]]


@pytest.fixture(scope="module")
def models_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "verify_cli_models.py"
    path.write_text(_MODELS)
    return path


@pytest.fixture
def on_path(models_file: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.syspath_prepend(str(models_file.parent))
    return "verify_cli_models"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, models_file: Path) -> Path:
    """A tiny Llama saved with save_pretrained, with a word-level tokenizer next to it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = tmp_path_factory.mktemp("checkpoint")
    config = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    words = ["<unk>", "<pad>", "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", pad_token="<pad>"
    )
    fast.save_pretrained(path)
    return path


@pytest.fixture
def jsonl(tmp_path: Path) -> Path:
    path = tmp_path / "data.jsonl"
    lines = [json.dumps(row) for row in _ROWS[:3]]
    lines += ["", json.dumps({"input_ids": _ROWS[3]}), json.dumps({"input_ids": _ROWS[4]})]
    path.write_text("\n".join(lines) + "\n")
    return path


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["verify", *args])
    out, err = capsys.readouterr()
    return code, out, err


def _one_line_error(code: int, err: str) -> str:
    assert code == 2
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("fullbatch verify: error: ")
    return lines[0]


def test_module_factory_and_jsonl_pass(capsys, on_path: str, jsonl: Path) -> None:
    code, out, _ = _run(
        capsys, "--model", f"{on_path}:make", "--data", str(jsonl), "--micro-batch-size", "2"
    )
    assert code == 0, out
    assert out.startswith("fullbatch verify: PASSED (float32, tolerance 1e-05")
    assert "5 rows -> 3 micro-batches" in out


def test_file_factory_with_batch_size_and_float64(capsys, models_file: Path, jsonl: Path) -> None:
    code, out, _ = _run(
        capsys,
        "--model",
        f"{models_file}:make",
        "--data",
        str(jsonl),
        "--micro-batch-size",
        "1",
        "--batch-size",
        "4",
        "--dtype",
        "float64",
    )
    assert code == 0, out
    assert "4 rows -> 4 micro-batches" in out
    # Llama's RMSNorm computes in float32 even in a float64 model: detected and said so
    assert "(float64, tolerance 1e-05" in out and "computes partly in float32" in out


def test_factory_loss_fn_that_is_a_mean_exits_1(capsys, on_path: str, jsonl: Path) -> None:
    code, out, _ = _run(
        capsys,
        "--model",
        f"{on_path}:make_with_mean_loss",
        "--data",
        str(jsonl),
        "--micro-batch-size",
        "2",
    )
    assert code == 1
    assert "FAILED" in out and "mean-reduced loss" in out


def test_checkpoint_with_jsonl(capsys, checkpoint: Path, jsonl: Path) -> None:
    code, out, _ = _run(
        capsys, "--model", str(checkpoint), "--data", str(jsonl), "--micro-batch-size", "2"
    )
    assert code == 0, out
    assert "PASSED" in out


def test_checkpoint_tokenizes_text(capsys, checkpoint: Path, tmp_path: Path) -> None:
    text = tmp_path / "data.txt"
    text.write_text("the quick brown fox\nthe lazy dog\nfox jumps over the lazy dog\nthe dog\n")
    code, out, _ = _run(
        capsys, "--model", str(checkpoint), "--data", str(text), "--micro-batch-size", "3"
    )
    assert code == 0, out
    assert "4 rows -> 2 micro-batches" in out
    assert "11 counted items" in out  # 4 + 3 + 6 + 2 words, minus the first of each row


def test_text_is_byte_level_without_tokenizer(capsys, on_path: str, tmp_path: Path) -> None:
    text = tmp_path / "data.txt"
    text.write_text("héllo\nhi\n")
    code, out, _ = _run(
        capsys, "--model", f"{on_path}:make", "--data", str(text), "--micro-batch-size", "1"
    )
    assert code == 0, out
    assert "6 counted items" in out  # 6 bytes + 2 bytes, minus one per row


def test_malformed_jsonl_names_the_line(capsys, on_path: str, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text("[1, 2, 3]\n\n[4, 5\n")
    code, _, err = _run(
        capsys, "--model", f"{on_path}:make", "--data", str(bad), "--micro-batch-size", "2"
    )
    line = _one_line_error(code, err)
    assert f"{bad} line 3: not valid JSON" in line and "list of token ids" in line


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('"text"\n[1, 2]\n', "line 1: got str, expected a list of token ids"),
        ('{"ids": [1]}\n[1, 2]\n', 'line 1: "input_ids" must be a list of integers'),
        ("[1, 2]\n[3, 400]\n", "line 2: token id 400 is outside the model's vocabulary (0..299)"),
        ("[1, 2]\n", "1 example(s); verify needs at least 2 rows"),
    ],
)
def test_bad_data_is_one_line(capsys, on_path: str, tmp_path: Path, content, message) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text(content)
    code, _, err = _run(
        capsys, "--model", f"{on_path}:make", "--data", str(data), "--micro-batch-size", "2"
    )
    assert message in _one_line_error(code, err)


def test_missing_data_file(capsys, on_path: str, tmp_path: Path) -> None:
    code, _, err = _run(
        capsys,
        "--model",
        f"{on_path}:make",
        "--data",
        str(tmp_path / "nope.jsonl"),
        "--micro-batch-size",
        "2",
    )
    assert "nope.jsonl: no such file; pass a .jsonl file" in _one_line_error(code, err)


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        ("verify_cli_models:nope", "module verify_cli_models has no attribute 'nope'"),
        ("no_such_module_xyz:make", "cannot import no_such_module_xyz (ModuleNotFoundError"),
        ("verify_cli_models:not_callable", "not_callable is a int, not callable"),
        ("verify_cli_models:broken", "the factory raised RuntimeError: weights not found"),
        ("verify_cli_models:no_logits", "the model returned dict without logits"),
        ("verify_cli_models:make_small_vocab", "byte-level tokenization of text needs"),
        ("no/such/dir", "no such directory, and not module:factory"),
    ],
)
def test_bad_model_is_one_line(capsys, on_path, tmp_path: Path, factory, message) -> None:
    data = tmp_path / "data.txt"
    data.write_text("one example\nanother\n")
    code, _, err = _run(capsys, "--model", factory, "--data", str(data), "--micro-batch-size", "1")
    assert message in _one_line_error(code, err)


def test_directory_without_config(capsys, tmp_path: Path, jsonl: Path) -> None:
    code, _, err = _run(
        capsys, "--model", str(tmp_path), "--data", str(jsonl), "--micro-batch-size", "2"
    )
    assert "no config.json in this directory" in _one_line_error(code, err)


def test_batch_size_larger_than_data(capsys, checkpoint: Path, jsonl: Path) -> None:
    # after a checkpoint load: no progress bar on stderr either
    code, _, err = _run(
        capsys,
        "--model",
        str(checkpoint),
        "--data",
        str(jsonl),
        "--micro-batch-size",
        "2",
        "--batch-size",
        "9",
    )
    assert "--batch-size 9: " in _one_line_error(code, err)


def test_console_entry_exit_code_and_stderr(tmp_path: Path) -> None:
    # the real process: exit status 2 and a single stderr line, no traceback
    command = [sys.executable, "-m", "fullbatch", "verify", "--model", "m:f"]
    command += ["--data", "missing.txt", "--micro-batch-size", "2"]
    src = str(Path(__file__).parents[2] / "src")
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": src},
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        "fullbatch verify: error: --data missing.txt: no such file; pass a .jsonl file of token "
        "ids or a text file with one example per line"
    ]

"""Every user error of ``fullbatch verify`` is one stderr line and exit 2 (issue 8, item 8).

Exit 1 means "not equivalent"; a traceback or exit 1 for bad input would read as a verdict.
"""

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


    def gpt2(n_positions=64):
        config = transformers.GPT2Config(
            vocab_size=64, n_positions=n_positions, n_embd=16, n_layer=1, n_head=2,
            bos_token_id=0, eos_token_id=0,
        )
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(config)


    def short_context():
        return gpt2(n_positions=8)


    def _logits(model, micro):
        return model(input_ids=micro["input_ids"]).logits


    def bare_tensor_loss():
        def loss_fn(model, micro):
            loss_sum, count = fb.causal_lm_loss(_logits(model, micro), micro["labels"])
            return loss_sum / count  # a bare tensor, no count

        return gpt2(), loss_fn


    def float_loss():
        def loss_fn(model, micro):
            loss_sum, count = fb.causal_lm_loss(_logits(model, micro), micro["labels"])
            return loss_sum.item(), count  # a float: no gradient

        return gpt2(), loss_fn


    class Raises(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(64, 4)

        def forward(self, input_ids):
            raise RuntimeError("shape mismatch in layer 3")


    def raising_forward():
        return Raises()
    """
)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "cli_error_models.py"
    path.write_text(_MODELS)
    return path


def _rows(count: int = 4, length: int = 6) -> list[list[int]]:
    return [[(7 * r + t) % 60 + 1 for t in range(length - r % 3)] for r in range(count)]


@pytest.fixture
def jsonl(tmp_path: Path) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in _rows()) + "\n")
    return path


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["verify", *args])
    out, err = capsys.readouterr()
    return code, out, err


def _one_line_error(code: int, err: str) -> str:
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert code == 2, err
    assert lines[0].startswith("fullbatch verify: error: ")
    return lines[0]


@pytest.mark.parametrize(
    ("factory", "expected"),
    [
        ("bare_tensor_loss", "loss_fn returned a Tensor, expected (loss_sum, count)"),
        ("float_loss", "loss_fn returned loss_sum as a float"),
        ("raising_forward", "RuntimeError: shape mismatch in layer 3"),
    ],
)
def test_user_code_errors_are_one_line(capsys, models: Path, jsonl: Path, factory, expected):
    code, _, err = _run(
        capsys, "--model", f"{models}:{factory}", "--data", str(jsonl), "--micro-batch-size", "2"
    )
    assert expected in _one_line_error(code, err)


def test_rows_longer_than_the_context_suggest_max_length(capsys, models: Path, tmp_path: Path):
    data = tmp_path / "long.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in _rows(4, length=12)) + "\n")
    spec = f"{models}:short_context"
    code, _, err = _run(capsys, "--model", spec, "--data", str(data), "--micro-batch-size", "2")
    line = _one_line_error(code, err)
    assert "12 tokens" in line and "context of 8 tokens (config.n_positions)" in line
    assert "--max-length 8" in line
    code, out, err = _run(
        capsys, "--model", spec, "--data", str(data), "--micro-batch-size", "2", "--max-length", "8"
    )
    assert code == 0, out + err
    assert out.startswith("fullbatch verify: PASSED")
    assert "rows cut to --max-length 8" in out


@pytest.mark.parametrize("as_dicts", [False, True])
def test_json_file_with_one_array_is_accepted(capsys, models: Path, tmp_path: Path, as_dicts):
    data = tmp_path / "rows.json"
    rows = _rows()
    data.write_text(json.dumps([{"input_ids": r} for r in rows] if as_dicts else rows, indent=2))
    code, out, err = _run(
        capsys, "--model", f"{models}:gpt2", "--data", str(data), "--micro-batch-size", "2"
    )
    assert code == 0, out + err
    assert "4 rows -> 2 micro-batches" in out


def test_bad_item_in_a_json_array_names_it(capsys, models: Path, tmp_path: Path):
    data = tmp_path / "rows.json"
    data.write_text(json.dumps([[1, 2, 3], "text", [4, 5]]))
    code, _, err = _run(
        capsys, "--model", f"{models}:gpt2", "--data", str(data), "--micro-batch-size", "1"
    )
    assert f"{data} item 2: got str" in _one_line_error(code, err)


def test_syntax_error_in_a_model_file_names_file_and_line(capsys, tmp_path: Path, jsonl: Path):
    model_file = tmp_path / "broken_model.py"
    model_file.write_text("import torch\n\ndef make(:\n    return torch.nn.Linear(2, 2)\n")
    code, _, err = _run(
        capsys, "--model", f"{model_file}:make", "--data", str(jsonl), "--micro-batch-size", "2"
    )
    line = _one_line_error(code, err)
    assert f"syntax error in {model_file}:3" in line
    assert "PYTHONPATH" not in line


def test_import_error_inside_a_model_file_does_not_suggest_pythonpath(capsys, tmp_path, jsonl):
    model_file = tmp_path / "needs_missing.py"
    model_file.write_text("import no_such_dependency_xyz\n\ndef make():\n    pass\n")
    code, _, err = _run(
        capsys, "--model", f"{model_file}:make", "--data", str(jsonl), "--micro-batch-size", "2"
    )
    line = _one_line_error(code, err)
    assert "no_such_dependency_xyz" in line and "PYTHONPATH" not in line


@pytest.mark.parametrize("size", ["4", "9"])
def test_micro_batch_size_not_below_the_rows_is_refused(capsys, models, jsonl: Path, size):
    code, _, err = _run(
        capsys, "--model", f"{models}:gpt2", "--data", str(jsonl), "--micro-batch-size", size
    )
    line = _one_line_error(code, err)
    assert f"--micro-batch-size {size} >= the batch's 4 rows" in line
    assert "--micro-batch-size 2" in line


def test_model_file_imports_a_sibling_module(capsys, tmp_path: Path, jsonl: Path):
    """The file's folder is on sys.path, as with `python file.py` (issue 18)."""
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "common_layers_18.py").write_text(
        "import torch\n\ndef make():\n    torch.manual_seed(0)\n"
        "    return torch.nn.Sequential(torch.nn.Embedding(64, 8), torch.nn.Linear(8, 64))\n"
    )
    (folder / "my_model.py").write_text(
        "from common_layers_18 import make\n\ndef factory():\n    return make()\n"
    )
    spec = f"{folder / 'my_model.py'}:factory"
    code, out, err = _run(capsys, "--model", spec, "--data", str(jsonl), "--micro-batch-size", "2")
    assert code == 0, out + err
    assert out.startswith("fullbatch verify: PASSED")


def test_failed_import_prints_the_error_and_its_line(capsys, tmp_path: Path, jsonl: Path):
    model_file = tmp_path / "imports_missing.py"
    model_file.write_text("import torch\n\nimport no_such_sibling_18\n\ndef make():\n    pass\n")
    code, _, err = _run(
        capsys, "--model", f"{model_file}:make", "--data", str(jsonl), "--micro-batch-size", "2"
    )
    line = _one_line_error(code, err)
    assert (
        f"importing {model_file} failed at {model_file}:3: ModuleNotFoundError: No module "
        "named 'no_such_sibling_18'" in line
    )
    assert "python " not in line  # not "run the file": the error itself is the message

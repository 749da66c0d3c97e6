"""``fullbatch demo``: the end-to-end run (CSV, PNG, verdict), its corpus, recipes and errors.

The numbers asserted here are computed by the run under test, never written in: fullbatch's
shadow-gradient error must be rounding-small and naive's must not.
"""

from __future__ import annotations

import contextlib
import csv
import io
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fullbatch import cli
from fullbatch._demo._arms import Arm, GradientRecorder, make_arm, relative_error
from fullbatch._demo._corpus import (
    EXCLUDED_DIRS,
    IGNORE_INDEX,
    PAD_ID,
    docstrings,
    encode_bytes,
    make_batches,
    read_corpus,
    source_files,
    stdlib_root,
)
from fullbatch._demo._experiment import Record
from fullbatch._demo._report import judge, table_header, table_row

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

COLUMNS = [
    "step",
    "arm",
    "micro_batch_size",
    "true_loss",
    "reported_loss",
    "shadow_grad_error",
    "param_distance",
]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_demo(*argv: str) -> tuple[int, str, str]:
    """Exit status, stdout and stderr of ``fullbatch demo ARGV``."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["demo", *argv])
    return code, out.getvalue(), err.getvalue()


def read_metrics(directory: Path) -> list[dict[str, str]]:
    with (directory / "metrics.csv").open(newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        assert reader.fieldnames == COLUMNS
        return list(reader)


def column(rows: list[dict[str, str]], arm: str, name: str, m: int | None = None) -> list[float]:
    return [
        float(r[name])
        for r in rows
        if r["arm"] == arm and (m is None or int(r["micro_batch_size"]) == m)
    ]


# -- the end-to-end run ---------------------------------------------------------------------

STEPS, BATCH, SIZES = 3, 4, (1, 2)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, Path]:
    out = tmp_path_factory.mktemp("demo")
    sizes = ",".join(map(str, SIZES))
    code, stdout, _ = run_demo(
        "--steps", str(STEPS), "--batch-size", str(BATCH), "--micro-batch-sizes", sizes,
        "--max-length", "64", "--out", str(out),
    )  # fmt: skip
    return code, stdout, out


def test_demo_writes_a_valid_png(demo: tuple[int, str, Path]) -> None:
    from matplotlib.image import imread

    png = demo[2] / "loss.png"
    assert png.read_bytes()[:8] == PNG_MAGIC
    height, width, _ = imread(png).shape
    assert width > 1000 and height > 600


def test_demo_csv_has_one_row_per_step_and_arm(demo: tuple[int, str, Path]) -> None:
    rows = read_metrics(demo[2])
    arms = [("full_batch", BATCH), ("permuted_rows", BATCH)]
    arms += [(name, m) for name in ("naive", "fullbatch") for m in SIZES]
    assert len(rows) == STEPS * len(arms)
    for step in range(1, STEPS + 1):
        got = [(r["arm"], int(r["micro_batch_size"])) for r in rows if int(r["step"]) == step]
        assert sorted(got) == sorted(arms)
    assert all(math.isfinite(float(r[c])) for r in rows for c in COLUMNS[3:])


def test_demo_fullbatch_is_exact_and_naive_is_not(demo: tuple[int, str, Path]) -> None:
    code, _, out = demo
    rows = read_metrics(out)
    assert column(rows, "full_batch", "shadow_grad_error") == [0.0] * STEPS
    assert column(rows, "full_batch", "param_distance") == [0.0] * STEPS
    assert max(column(rows, "fullbatch", "shadow_grad_error")) < 1e-5
    assert max(column(rows, "permuted_rows", "shadow_grad_error")) < 1e-5
    for m in SIZES:
        assert max(column(rows, "naive", "shadow_grad_error", m)) > 1e-3
    # fullbatch logs the true loss; naive logs the mean of micro-batch means.
    fb_true = column(rows, "fullbatch", "true_loss")
    fb_reported = column(rows, "fullbatch", "reported_loss")
    assert fb_reported == pytest.approx(fb_true, rel=1e-6)
    naive_gap = [
        abs(a - b)
        for a, b in zip(
            column(rows, "naive", "reported_loss"), column(rows, "naive", "true_loss"), strict=True
        )
    ]
    assert max(naive_gap) > 1e-4
    assert code == 0


def test_demo_verdict_names_python_and_corpus(demo: tuple[int, str, Path]) -> None:
    stdout = " ".join(demo[1].split())  # undo line wrapping
    version = ".".join(map(str, sys.version_info[:3]))
    assert re.search(rf"Verdict \(Python {re.escape(version)}, corpus [0-9a-f]{{12}}\):", stdout)
    assert "PASS" in stdout
    assert "metrics.csv" in stdout and "loss.png" in stdout
    assert "1 CPU thread(s) (--threads)" in stdout  # chosen and printed (issue 18)


def _save_byte_tokenizer(directory: Path) -> None:
    # A byte-level tokenizer built offline: 256 byte symbols, no merges, three special tokens.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"
    )
    assert len(fast) == 259
    fast.save_pretrained(directory)


def test_demo_with_a_local_checkpoint(tmp_path: Path) -> None:
    from fullbatch._demo._model import tiny_llama

    checkpoint = tmp_path / "tiny-llama"
    tiny_llama(seed=3, max_length=64, dtype=torch.float32).model.save_pretrained(checkpoint)
    _save_byte_tokenizer(checkpoint)
    code, stdout, _ = run_demo(
        "--model", str(checkpoint), "--steps", "2", "--batch-size", "4",
        "--micro-batch-sizes", "1,2", "--max-length", "64", "--out", str(tmp_path / "out"),
    )  # fmt: skip
    stdout = " ".join(stdout.split())  # undo line wrapping
    assert "tiny-llama (LlamaForCausalLM" in stdout
    assert "sgd lr" in stdout  # SGD is the default with --model
    rows = read_metrics(tmp_path / "out")
    assert len(rows) == 2 * 6
    assert max(column(rows, "fullbatch", "shadow_grad_error")) < 1e-5
    assert code == 0, stdout


def test_demo_refuses_a_missing_checkpoint(tmp_path: Path) -> None:
    code, _, stderr = run_demo("--model", str(tmp_path / "nope"), "--out", str(tmp_path))
    assert code == 2
    assert "not a directory" in stderr and "Traceback" not in stderr


# -- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize("missing", ["transformers", "matplotlib", "tqdm"])
def test_missing_extra_is_one_line_with_the_install_command(
    missing: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, missing, None)  # makes `import missing` raise ImportError
    code, stdout, stderr = run_demo("--out", str(tmp_path))
    assert code == 2
    assert stdout == ""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1
    assert missing in lines[0] and "pip install 'fullbatch[demo]'" in lines[0]


def test_micro_batch_size_must_be_smaller_than_the_batch(tmp_path: Path) -> None:
    code, _, stderr = run_demo("--batch-size", "4", "--micro-batch-sizes", "2,4")
    assert code == 2
    assert "--micro-batch-sizes 4" in stderr and "--batch-size 4" in stderr


def test_unusable_device_is_refused_before_training(tmp_path: Path) -> None:
    code, stdout, stderr = run_demo("--device", "no-such-device", "--out", str(tmp_path))
    assert code == 2 and stdout == ""
    assert "--device 'no-such-device'" in stderr and "--device cpu" in stderr


def test_bad_micro_batch_list_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as exc:
        run_demo("--micro-batch-sizes", "1,zero")
    assert exc.value.code == 2


def test_declaring_the_options_imports_nothing_heavy() -> None:
    # `fullbatch --help` builds every subcommand's parser: the demo's must stay cheap.
    code = (
        "import argparse, sys; import fullbatch; before = set(sys.modules);"
        "import fullbatch._demo as d; d.add_arguments(argparse.ArgumentParser());"
        "heavy = ('transformers', 'matplotlib', 'tqdm');"
        "print(sorted(m for m in set(sys.modules) - before if m.split('.')[0] in heavy))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


# -- the corpus ------------------------------------------------------------------------------


def test_stdlib_sources_leave_out_tests_idle_and_packages() -> None:
    files = source_files(stdlib_root())
    assert len(files) > 100
    assert any(f.name == "ast.py" for f in files)
    assert not any(EXCLUDED_DIRS & set(f.parts) for f in files)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def test_excluded_directories_are_skipped(tmp_path: Path) -> None:
    _write(tmp_path / "pkg" / "kept.py", '"""Kept module."""\ndef f():\n    """Kept function."""\n')
    for excluded in ("test", "tests", "idlelib", "site-packages", "pkg/test"):
        _write(tmp_path / excluded / "skipped.py", '"""Skipped."""\n')
    _write(tmp_path / "broken.py", "print 'python 2'\n")
    assert [f.name for f in source_files(tmp_path)] == ["broken.py", "kept.py"]
    assert docstrings(tmp_path / "broken.py") == []
    corpus = read_corpus(5, seed=0, encode=lambda t: encode_bytes(t, max_length=64), root=tmp_path)
    assert set(corpus.texts) == {"Kept module.", "Kept function."}
    assert len(corpus.rows) == 5  # repeated, since the tree holds only two docstrings


def test_read_corpus_names_an_empty_root(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=re.escape(str(tmp_path))):
        read_corpus(3, seed=0, encode=list, root=tmp_path)
    with pytest.raises(ValueError, match="n=0"):
        read_corpus(0, seed=0, encode=list, root=tmp_path)


def test_corpus_is_seeded_and_variable_length() -> None:
    def encode(text: str) -> list[int]:
        return encode_bytes(text, max_length=128)

    first = read_corpus(64, seed=0, encode=encode)
    again = read_corpus(64, seed=0, encode=encode)
    other = read_corpus(64, seed=1, encode=encode)
    assert first == again
    assert other.digest != first.digest
    lengths = [len(row) for row in first.rows]
    assert len(set(lengths)) > 10
    assert min(lengths) < 64 and max(lengths) == 128
    assert all(row[0] == 256 for row in first.rows)


def test_batches_pad_right_and_ignore_padding() -> None:
    batches = make_batches(
        [[256, 7, 257], [256, 257], [256, 1, 2, 3, 257]], batch_size=2, pad_id=PAD_ID
    )
    assert len(batches) == 1  # the third row does not fill a batch
    batch = batches[0]
    assert batch["input_ids"].tolist() == [[256, 7, 257], [256, 257, PAD_ID]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["labels"].tolist() == [[256, 7, 257], [256, 257, IGNORE_INDEX]]


# -- recipes and the verdict -----------------------------------------------------------------


def _arm(name: str, m: int, model: torch.nn.Module) -> Arm:
    return make_arm(name, m, model, lambda p: torch.optim.SGD(p, lr=0.1))


def test_naive_is_exact_only_when_micro_batches_hold_equal_counts() -> None:
    from fullbatch._demo._model import tiny_llama

    model = tiny_llama(seed=0, max_length=32, dtype=torch.float32).model
    equal = make_batches(
        [[256, *range(i, i + 9), 257] for i in range(4)], batch_size=4, pad_id=PAD_ID
    )[0]
    unequal = make_batches(
        [[256, *range(1, 2 + 6 * i), 257] for i in range(4)], batch_size=4, pad_id=PAD_ID
    )[0]
    full, naive, exact = (
        _arm("full_batch", 4, model),
        _arm("naive", 1, model),
        _arm("fullbatch", 1, model),
    )
    before = [p.detach().clone() for p in model.parameters()]
    for batch, naive_exact in ((equal, True), (unequal, False)):
        reference = full.gradient_at(model, batch)
        assert relative_error(exact.gradient_at(model, batch), reference) < 1e-5
        naive_error = relative_error(naive.gradient_at(model, batch), reference)
        assert (naive_error < 1e-5) == naive_exact, naive_error
        assert naive_exact or naive_error > 1e-3
    # Shadow gradients leave the weights alone.
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_gradient_recorder_records_without_stepping() -> None:
    weight = torch.nn.Parameter(torch.ones(3))
    recorder = GradientRecorder([weight])
    (weight * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    recorder.step()
    assert recorder.recorded[0].tolist() == [1.0, 2.0, 3.0]
    assert weight.tolist() == [1.0, 1.0, 1.0]


def _records(fb_error: float, naive_error: float) -> list[Record]:
    out = []
    for step in (1, 2):
        out += [
            Record(step, "full_batch", 4, 2.0, 2.0, 0.0, 0.0),
            Record(step, "permuted_rows", 4, 2.0, 2.0, 1e-7, 1e-7),
            Record(step, "naive", 1, 2.1, 2.3, naive_error * step / 2, 0.1),
            Record(step, "fullbatch", 1, 2.0, 2.0, fb_error, 1e-7),
        ]
    return out


@pytest.mark.parametrize(
    ("fb_error", "naive_error", "code"),
    [(1e-7, 1e-2, 0), (1e-3, 1e-2, 1), (math.nan, 1e-2, 1), (1e-7, 1e-8, 1)],
)
def test_exit_code_needs_fullbatch_exact_and_naive_visibly_wrong(
    fb_error: float, naive_error: float, code: int
) -> None:
    verdict = judge(_records(fb_error, naive_error), tolerance=1e-5)
    assert verdict.exit_code == code
    assert verdict.naive_error == {1: naive_error}


def test_table_rows_line_up_with_the_header() -> None:
    def bars(line: str) -> list[int]:
        return [i for i, c in enumerate(line) if c == "|"]

    for sizes in ([1], [1, 2, 4]):
        records = _records(1e-7, 1e-2)[:4]
        records += [
            Record(1, a, m, 2.0, 2.0, 0.1, 0.1) for a in ("naive", "fullbatch") for m in sizes
        ]
        top, bottom = table_header(sizes).splitlines()
        row = table_row(records, sizes)
        assert bars(top) == bars(bottom) == bars(row)
        assert len(bottom) == len(row)

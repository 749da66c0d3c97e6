"""Where the probe finds a window's micro-batch (DESIGN part 5), on loops written as users write
them, each judged against a float64 full batch written here:

- a loop at a script's top level (``fullbatch probe -- python train.py``: runpy runs it as
  ``__main__``, so its loop variables are module globals) beside globals ``y`` and ``labels``
  that hold the whole data set: the labels are the loop's ``yb``, never a tensor whose rows are
  not the input's (and the script's namespace is no micro-batch);
- the LLMs-from-scratch loop as the book writes it (``for batch_idx, (input_batch,
  target_batch) in enumerate(train_loader)``, ``calc_loss_batch``): the built-in ``token``
  objective finds ``target_batch``; a callable objective receives ``(input_batch,
  target_batch)``; when it raises, its own error and traceback are shown;
- Composer's ``HuggingFaceModel`` (a stand-in: Composer pins an older torch): ``objective=None``
  is inferred through its ``.model``.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import fullbatch as fb

_SRC = str(Path(__file__).parents[2] / "src")
F64 = torch.float64


def _rel(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    diff = sum(float((g - r).pow(2).sum()) for g, r in zip(got, ref, strict=True))
    return (diff / sum(float(r.pow(2).sum()) for r in ref)) ** 0.5


def _printed_error(stdout: str) -> float:
    return float(re.search(r"gradient error (\S+) ", stdout).group(1))  # type: ignore[union-attr]


def _probe_cli(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": _SRC}
    return subprocess.run(
        [sys.executable, "-m", "fullbatch", "probe", *args],
        capture_output=True, text=True, cwd=folder, env=env, timeout=240,
    )  # fmt: skip


# -- a loop at a script's top level -----------------------------------------------------------

TOP_LEVEL = """
import sys
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
X = torch.randn(64, 6, dtype=torch.float64)
y = torch.randint(3, (64,))  # every label of the data set
labels = y  # the same, under the name a batch's labels often have
model = torch.nn.Linear(6, 3).double()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
K = 4
for step, (xb, yb) in enumerate(DataLoader(TensorDataset(X, y), batch_size=8)):
    loss = F.cross_entropy(model(xb), yb)
    if sys.argv[1] == "right":
        loss = loss / K
    loss.backward()
    if step + 1 == K:  # the first window's gradient, for the test's reference
        torch.save([p.grad for p in model.parameters()], sys.argv[2])
    if (step + 1) % K == 0:
        opt.step()
        opt.zero_grad()
"""


def _top_level_reference() -> list[torch.Tensor]:
    """The script's first window as one float64 batch: its first 32 rows, one mean."""
    torch.manual_seed(0)
    x = torch.randn(64, 6, dtype=F64)
    y = torch.randint(3, (64,))
    model = nn.Linear(6, 3).double()
    F.cross_entropy(model(x[:32]), y[:32]).backward()
    return [p.grad for p in model.parameters()]  # type: ignore[misc]


@pytest.mark.parametrize("how", ["right", "wrong"])
def test_a_top_level_loop_takes_its_own_labels_not_the_data_set(tmp_path: Path, how: str) -> None:
    (tmp_path / "train.py").write_text(textwrap.dedent(TOP_LEVEL))
    result = _probe_cli(
        tmp_path, "--objective", "sample", "--windows", "1", "--keep-training", "--",
        "python", "train.py", how, "applied.pt",
    )  # fmt: skip
    out = result.stdout + result.stderr
    applied = torch.load(tmp_path / "applied.pt")
    error = _rel(applied, _top_level_reference())
    assert "32 items (sample)" in out, out
    if how == "right":
        assert result.returncode == 0 and "RIGHT" in out, out
        assert error < 1e-14 and _printed_error(out) < 1e-12
        return
    assert result.returncode == 1, out
    assert "not normalized: every micro-batch weighted x4 (= K" in out, out
    assert error == pytest.approx(3.0, rel=1e-12)
    assert _printed_error(out) == pytest.approx(error, rel=0.05)


# -- the LLMs-from-scratch loop as the book writes it -------------------------------------------


class GPTDatasetV1(Dataset):  # the book's dataset: targets are the inputs shifted by one token
    def __init__(self, token_ids: list[int], max_length: int, stride: int) -> None:
        self.input_ids, self.target_ids = [], []
        for i in range(0, len(token_ids) - max_length, stride):
            self.input_ids.append(torch.tensor(token_ids[i : i + max_length]))
            self.target_ids.append(torch.tensor(token_ids[i + 1 : i + max_length + 1]))

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.input_ids[idx], self.target_ids[idx]


class TinyGPT(nn.Module):  # the book's GPTModel's interface: token ids in, logits out
    def __init__(self, vocab: int = 50, dim: int = 16, context: int = 8) -> None:
        super().__init__()
        self.tok_emb, self.pos_emb = nn.Embedding(vocab, dim), nn.Embedding(context, dim)
        self.block = nn.Sequential(nn.Linear(dim, dim), nn.GELU())
        self.out_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, in_idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(in_idx) + self.pos_emb(torch.arange(in_idx.shape[1]))
        return self.out_head(self.block(x))


def calc_loss_batch(input_batch, target_batch, model, device):  # type: ignore[no-untyped-def]
    input_batch, target_batch = input_batch.to(device), target_batch.to(device)
    logits = model(input_batch)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target_batch.flatten())
    return loss


def _book_loader() -> DataLoader:
    g = torch.Generator().manual_seed(3)
    text = torch.randint(50, (400,), generator=g).tolist()
    dataset = GPTDatasetV1(text, max_length=8, stride=8)
    return DataLoader(dataset, batch_size=4, shuffle=True, drop_last=True, generator=g)


def _book_model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT().double()


def train_with_accumulation(model, train_loader, optimizer, device, how):  # type: ignore[no-untyped-def]
    accumulation_steps = 4
    model.train()
    for batch_idx, (input_batch, target_batch) in enumerate(train_loader):
        loss = calc_loss_batch(input_batch, target_batch, model, device)
        if how != "not divided":
            loss = loss / accumulation_steps
        loss.backward()
        if how == "off by one":
            step_now = batch_idx % accumulation_steps == 0
        else:
            step_now = (batch_idx + 1) % accumulation_steps == 0
        if step_now:
            optimizer.step()
            optimizer.zero_grad()


def _book_reference(n: int) -> list[torch.Tensor]:
    """The book loop's first ``n`` batches as one float64 batch, one mean."""
    model = _book_model()
    pairs = [pair for pair, _ in zip(_book_loader(), range(n), strict=False)]
    inputs, targets = (torch.cat(part) for part in zip(*pairs, strict=True))
    F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
    return [p.grad for p in model.parameters()]  # type: ignore[misc]


class _FirstStepGrad:
    """The gradient the first ``step()`` applies, read by a step pre-hook."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
        self.grads: list[torch.Tensor] | None = None
        self.model = model
        optimizer.register_step_pre_hook(self._take)

    def _take(self, *_: object) -> None:
        if self.grads is None:
            self.grads = [p.grad.clone() for p in self.model.parameters()]  # type: ignore[union-attr]


def _book(how: str, objective: object) -> tuple[fb.ProbeReport, float]:
    """The probe's report on the first window, and that window's error against the float64
    full batch of its micro-batches (the first 4; the first alone when it steps after it)."""
    model = _book_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=4e-4, weight_decay=0.1)
    first = _FirstStepGrad(optimizer, model)
    with fb.probe(objective=objective, windows=1) as probe:
        train_with_accumulation(model, _book_loader(), optimizer, torch.device("cpu"), how)
    assert first.grads is not None
    return probe.report, _rel(first.grads, _book_reference(1 if how == "off by one" else 4))


def book_objective(model, micro):  # type: ignore[no-untyped-def]
    input_batch, target_batch = micro  # what the loop unpacked
    logits = model(input_batch)
    loss_sum = F.cross_entropy(logits.flatten(0, 1), target_batch.flatten(), reduction="sum")
    return loss_sum, target_batch.numel()


@pytest.mark.parametrize("objective", ["token", book_objective], ids=["token", "callable"])
def test_the_book_loop_is_probed_as_written(objective: object) -> None:
    report, error = _book("right", objective)
    assert report.ok and error < 1e-14, str(report)
    (check,) = report.windows
    assert check.micro_batches == 4 and check.count == 4 * 4 * 8 and check.error < 1e-12

    report, error = _book("not divided", objective)
    (check,) = report.windows
    assert not report.ok and check.pattern == "not normalized", str(report)
    assert "x4 (= K" in check.diagnosis and check.weights == pytest.approx([4.0] * 4, rel=1e-9)
    assert error == pytest.approx(3.0, rel=1e-12) and check.error == pytest.approx(3.0, rel=1e-9)

    report, error = _book("off by one", objective)  # step after micro-batch 1, 5, 9, ...
    (check,) = report.windows
    assert not report.ok and check.pattern == "partial window", str(report)
    assert "batch_idx % 4 == 0" in check.diagnosis and check.micro_batches == 1
    assert check.weights == pytest.approx([0.25], rel=1e-9)
    assert error == pytest.approx(0.75, rel=1e-12) and check.error == pytest.approx(0.75, rel=1e-9)


def test_a_callable_objective_receives_what_the_loop_unpacked() -> None:
    received: list[object] = []

    def objective(model, micro):  # type: ignore[no-untyped-def]
        received.append(micro)
        return book_objective(model, micro)

    model = _book_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with fb.probe(objective=objective, windows=1) as probe:
        train_with_accumulation(model, _book_loader(), optimizer, torch.device("cpu"), "right")
    assert probe.report.ok, str(probe.report)
    assert received and all(
        isinstance(m, tuple) and len(m) == 2 and all(isinstance(t, torch.Tensor) for t in m)
        for m in received
    )
    for inputs, targets in (pair for pair, _ in zip(_book_loader(), range(4), strict=False)):
        assert any(torch.equal(m[0], inputs) and torch.equal(m[1], targets) for m in received)


def bad_objective(model, micro):  # type: ignore[no-untyped-def]
    logits = model(micro[0])
    return F.cross_entropy(logits.flatten(0, 1), micro[2].flatten(), reduction="sum"), 1


def test_a_failing_objective_shows_its_own_error_and_traceback() -> None:
    model = _book_model()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError) as caught, fb.probe(objective=bad_objective, windows=1):
        train_with_accumulation(model, _book_loader(), optimizer, torch.device("cpu"), "right")
    text = str(caught.value)
    assert "bad_objective(model, micro) raised IndexError: tuple index out of range" in text
    assert "micro = tuple (Tensor[4, 8] int64, Tensor[4, 8] int64)" in text
    assert "Traceback (most recent call last)" in text and "micro[2].flatten()" in text
    assert "_call_loss.py" not in text  # the user's frames, not the probe's
    assert isinstance(caught.value.__cause__, IndexError)
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


BOOK_SCRIPT = """
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

{definitions}

torch.manual_seed(0)
text = torch.randint(50, (400,)).tolist()
train_loader = DataLoader(GPTDatasetV1(text, 8, 8), batch_size=4, shuffle=True, drop_last=True)
model = TinyGPT()
optimizer = torch.optim.AdamW(model.parameters(), lr=4e-4, weight_decay=0.1)
accumulation_steps = 4
for batch_idx, (input_batch, target_batch) in enumerate(train_loader):
    loss = calc_loss_batch(input_batch, target_batch, model, "cpu")
    loss = loss / accumulation_steps
    loss.backward()
    if (batch_idx + 1) % accumulation_steps == 0:
        optimizer.step()
        optimizer.zero_grad()
"""

BAD_OBJECTIVE = """
import torch.nn.functional as F

def loss(model, micro):
    logits = model(micro[0])
    return F.cross_entropy(logits.flatten(0, 1), micro[2].flatten(), reduction="sum"), 1
"""


def test_the_cli_shows_a_failing_objectives_traceback(tmp_path: Path) -> None:
    definitions = "\n\n".join(
        inspect.getsource(f) for f in (GPTDatasetV1, TinyGPT, calc_loss_batch)
    )
    (tmp_path / "train.py").write_text(BOOK_SCRIPT.format(definitions=definitions))
    (tmp_path / "obj.py").write_text(textwrap.dedent(BAD_OBJECTIVE))
    result = _probe_cli(tmp_path, "--objective", "obj.py:loss", "--", "python", "train.py")
    assert result.returncode == 2, result.stdout + result.stderr
    err = result.stderr
    assert "loss(model, micro) raised IndexError: tuple index out of range" in err, err
    assert "Traceback (most recent call last)" in err and 'obj.py", line 6, in loss' in err
    assert "micro[2].flatten()" in err and "_call_loss.py" not in err


# -- Composer's HuggingFaceModel -----------------------------------------------------------------


class HuggingFaceModel(nn.Module):
    """Composer's ``HuggingFaceModel`` shape: the transformers model as ``.model``,
    ``forward(batch)`` calls it on the batch mapping, ``loss`` returns its mean loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: dict[str, torch.Tensor]) -> object:
        return self.model(**batch)

    def loss(self, outputs: object, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return outputs.loss  # type: ignore[attr-defined]


def _composer_model() -> HuggingFaceModel:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=16, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return HuggingFaceModel(GPT2LMHeadModel(config).double())


def _composer_batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    out = []
    for lengths in ([8, 3], [2, 2], [8, 6]):
        ids = torch.randint(64, (2, 8), generator=g)
        labels = ids.clone()
        for row, n in enumerate(lengths):
            labels[row, n:] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def test_composer_huggingface_model_objective_inferred_through_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("transformers")
    monkeypatch.setattr(HuggingFaceModel, "__module__", "composer.models.huggingface")
    batches = _composer_batches()
    reference = _composer_model()
    ids = torch.cat([b["input_ids"] for b in batches])
    labels = torch.cat([b["labels"] for b in batches])
    logits = reference.model(input_ids=ids).logits
    F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()).backward()
    ref = [p.grad for p in reference.parameters()]
    total = int((labels[:, 1:] != -100).sum())

    for how in ("right", "mean/K"):
        model = _composer_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with fb.probe(windows=1) as probe:  # objective=None
            for batch in batches:  # Composer: outputs = model(batch); model.loss(outputs, batch)
                outputs = model(batch)
                if how == "right":
                    loss_sum = fb.causal_lm_loss(outputs.logits, batch["labels"])[0]
                    (loss_sum / total).backward()
                else:
                    (model.loss(outputs, batch) / len(batches)).backward()
            applied = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
            optimizer.step()
        (check,) = probe.report.windows
        assert check.objective == "causal_lm" and check.count == total
        if how == "right":
            assert probe.report.ok and _rel(applied, ref) < 1e-13, str(probe.report)
            continue
        assert not probe.report.ok and check.pattern == "mean of per-micro-batch means"
        assert check.error == pytest.approx(_rel(applied, ref), rel=1e-6)

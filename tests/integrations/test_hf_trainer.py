"""fullbatch.hf: the Hugging Face Trainer, accumulated, against the full batch.

References: plain PyTorch in float64 (each window's rows as one batch, a mean
``F.cross_entropy``, SGD) and the Trainer itself with ``gradient_accumulation_steps=1`` on the
whole batch. Errors are measured per optimizer step on the parameters, relative to how far the
reference moved them. Rows are real stdlib docstrings of varying length, right-padded, labels
-100 at padding (and at unmasked positions for masked LM, at some rows for classification).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
import transformers

import fullbatch as fb
import fullbatch.hf as fbhf
from _dist import run_ranks, values
from _hf_cases import (
    Collator,
    bert,
    ddp_rank,
    in_order,
    llama,
    rel,
    run,
    step_errors,
    text_rows,
    torch_reference,
    training_args,
    windows_of,
)

F64_TOL = 1e-10  # float64 end to end (BERT): rounding only
# The float64 tiny Llama computes RMSNorm in float32 inside: backpropagating the summed loss
# and scaling afterwards (ExactTrainer) instead of backpropagating the mean rounds differently
# there, by 2e-8 measured (plain PyTorch, no Trainer: grad(sum) / N vs grad(sum / N)).
LLAMA_TOL = 1e-7


@pytest.fixture(scope="module")
def rows() -> list[dict[str, Any]]:
    return text_rows(40)  # 40 rows, 4 per micro-batch, K=4: windows of 16, 16 and 8 rows


# What the *stock* Trainer gets wrong (or right) is asserted on transformers 5 (CI: 5.23).
# Older Trainers differ there (4.53.3: a float64 Llama's full batch is 2% off the reference, BERT's
# masked-LM head takes no loss kwargs, a partial window is scaled differently); ExactTrainer's
# own assertions run on every version.
STOCK_AS_ON_CI = int(transformers.__version__.split(".")[0]) >= 5
# transformers 4 rounds the logged loss to 4 decimals; 5 logs it unrounded.
LOG_ROUNDING = 0.0 if STOCK_AS_ON_CI else 5e-5


def _losses_close(got: list[float], ref: list[float]) -> None:
    # The Trainer logs through a float32 accumulator (transformers 4: rounded to 4 decimals).
    assert len(got) == len(ref)
    for g, r in zip(got, ref, strict=True):
        assert abs(g - r) <= 1e-6 * abs(r) + LOG_ROUNDING, (got, ref)


@pytest.mark.parametrize("average_tokens", [True, False])
def test_causal_lm_every_step_equals_full_batch(rows: list[Any], average_tokens: bool) -> None:
    ref = torch_reference(llama, windows_of(rows, 16), "causal_lm")
    got = run(
        llama,
        rows,
        "causal_lm",
        k=4,
        batch=4,
        exact="causal_lm",
        average_tokens_across_devices=average_tokens,
    )
    errors = step_errors(got, ref, llama())
    assert len(errors) == 3  # the last window (2 micro-batches, 8 rows) is stepped
    assert max(errors) < LLAMA_TOL, errors
    _losses_close(got["losses"], ref["losses"])  # the logged loss is the window's true loss


def test_trainer_full_batch_is_the_reference(rows: list[Any]) -> None:
    """The Trainer with no accumulation agrees with the plain-PyTorch reference (HF's causal
    loss upcasts logits to float32, hence 1e-6), and so does ExactTrainer with K=1."""
    ref = torch_reference(llama, windows_of(rows, 16), "causal_lm")
    stock = run(llama, rows, "causal_lm", k=1, batch=16)
    exact = run(llama, rows, "causal_lm", k=1, batch=16, exact="causal_lm")
    if STOCK_AS_ON_CI:
        assert max(step_errors(stock, ref, llama())) < 1e-6
    assert max(step_errors(exact, ref, llama())) < LLAMA_TOL


def test_head_that_drops_num_items_in_batch(rows: list[Any]) -> None:
    """BERT's masked-LM head takes **kwargs, so the Trainer passes num_items_in_batch and does
    not divide by K; the head ignores it and returns a per-micro-batch mean."""
    make = lambda: bert("masked_lm")  # noqa: E731
    ref = torch_reference(make, windows_of(rows, 16), "masked_lm")
    if STOCK_AS_ON_CI:
        stock = run(make, rows, "masked_lm", k=4, batch=4)
        assert stock["trainer"].model_accepts_loss_kwargs
        stock_errors = step_errors(stock, ref, make())
        assert min(stock_errors) > 1.0, stock_errors  # roughly K times the full-batch step
    full = run(make, rows, "masked_lm", k=1, batch=16)  # the stock full batch is right
    assert max(step_errors(full, ref, make())) < F64_TOL
    exact = run(make, rows, "masked_lm", k=4, batch=4, exact="token")
    assert max(step_errors(exact, ref, make())) < F64_TOL
    _losses_close(exact["losses"], ref["losses"])


def test_sequence_classification(rows: list[Any]) -> None:
    make = lambda: bert("classification")  # noqa: E731
    ref = torch_reference(make, windows_of(rows, 16), "classification")
    if STOCK_AS_ON_CI:
        stock = run(make, rows, "classification", k=4, batch=4)
        assert min(step_errors(stock, ref, make())) > 1.0
    exact = run(make, rows, "classification", k=4, batch=4, exact="sample")
    assert max(step_errors(exact, ref, make())) < F64_TOL
    _losses_close(exact["losses"], ref["losses"])


def test_custom_loss_function(rows: list[Any]) -> None:
    calls = []

    def loss(outputs: Any, labels: torch.Tensor) -> tuple[torch.Tensor, Any]:
        calls.append(labels.shape)
        loss_sum, n = fb.causal_lm_loss(outputs.logits, labels)
        return loss_sum, int(n)  # a plain int count is accepted too

    ref = torch_reference(llama, windows_of(rows, 16), "causal_lm")
    got = run(llama, rows, "causal_lm", k=4, batch=4, exact=loss)
    assert len(calls) == 10
    assert max(step_errors(got, ref, llama())) < LLAMA_TOL


def test_clipping_sees_the_full_batch_gradient(rows: list[Any]) -> None:
    ref = torch_reference(llama, windows_of(rows, 16), "causal_lm", max_grad_norm=0.05)
    unclipped = torch_reference(llama, windows_of(rows, 16), "causal_lm")
    got = run(llama, rows, "causal_lm", k=4, batch=4, exact="causal_lm", max_grad_norm=0.05)
    assert max(step_errors(unclipped, ref, llama())) > 0.5  # clipping really acts
    assert max(step_errors(got, ref, llama())) < LLAMA_TOL
    norms = [h["grad_norm"] for h in got["trainer"].state.log_history if "grad_norm" in h]
    assert min(norms) > 0.05  # the logged norm is the pre-clip full-batch norm


def test_float32(rows: list[Any]) -> None:
    make = lambda: llama(torch.float32)  # noqa: E731
    ref = torch_reference(make, windows_of(rows, 16), "causal_lm")
    got = run(make, rows, "causal_lm", k=4, batch=4, exact="causal_lm")
    assert max(step_errors(got, ref, make())) < 1e-5


def test_window_without_counted_items_updates_nothing(rows: list[Any]) -> None:
    start = {n: p.detach().clone() for n, p in llama().named_parameters()}
    with pytest.warns(RuntimeWarning, match="no items counted in the window"):
        got = run(llama, rows[:8], "all_ignored", k=2, batch=4, exact="causal_lm")
    assert len(got["steps"]) == 1
    for name, value in got["steps"][0].items():
        assert torch.equal(value, start[name]), name


def test_window_without_counted_items_leaves_the_schedule(rows: list[Any]) -> None:
    """Linear decay over 2 steps; window 1 counts nothing, so window 2 steps with lr(0) = 0.1,
    as a run over window 2 alone does (lr(1) = 0.05 had the scheduler moved)."""
    with pytest.warns(RuntimeWarning, match="no items counted in the window"):
        got = run(
            llama,
            rows[:16],
            "first_two_ignored",
            k=2,
            batch=4,
            exact="causal_lm",
            lr_scheduler_type="linear",
        )
    alone = run(
        llama, rows[8:16], "causal_lm", k=2, batch=4, exact="causal_lm", lr_scheduler_type="linear"
    )
    assert len(got["steps"]) == 2 and len(alone["steps"]) == 1
    assert got["trainer"].lr_scheduler.last_epoch == 1  # one real step
    assert rel(got["steps"][1], alone["steps"][0]) < 1e-12


def _trainer(tmp_path: Any, model: Any, kind: str, k: int = 4, **kw: Any) -> Any:
    from transformers import Trainer

    args = training_args(str(tmp_path), k=k, batch=2)
    exact = kw.pop("exact", None)
    common = dict(model=model, args=args, data_collator=Collator(kind), **kw)
    trainer = Trainer(**common) if exact is None else fbhf.ExactTrainer(**common, loss=exact)
    return in_order(trainer)


def test_check_trainer(tmp_path: Any, rows: list[Any]) -> None:
    model = bert("classification")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    stock = fbhf.check_trainer(_trainer(tmp_path, model, "classification"), rows)
    assert not stock.passed
    assert "FAILED" in str(stock) and "4.00x" in stock.reason
    assert "ExactTrainer" in stock.reason  # the fix
    exact_trainer = _trainer(tmp_path, model, "classification", exact="sample")
    good = fbhf.check_trainer(exact_trainer, rows)
    assert good.passed, str(good)
    assert "PASSED" in str(good) and good.accumulated.global_rel_error < F64_TOL
    for name, p in model.named_parameters():  # the user's model is untouched
        assert torch.equal(p, before[name]) and p.grad is None, name
    assert exact_trainer._fb_c == 1.0 and exact_trainer._fb_window is None
    assert exact_trainer.fb_counters.windows == 0  # the check left no count behind
    # Llama's head consumes num_items_in_batch: the stock Trainer is exact there, and says so.
    llama_check = fbhf.check_trainer(_trainer(tmp_path, llama(), "causal_lm"), rows)
    assert llama_check.passed, str(llama_check)


def test_check_trainer_refuses(tmp_path: Any, rows: list[Any]) -> None:
    trainer = _trainer(tmp_path, llama(), "causal_lm", k=1)
    with pytest.raises(ValueError, match="at least 2 micro-batches"):
        fbhf.check_trainer(trainer, rows)
    with pytest.raises(ValueError, match="needs 8 rows"):
        fbhf.check_trainer(_trainer(tmp_path, llama(), "causal_lm"), rows[:5])


def test_refused_settings(tmp_path: Any, rows: list[Any]) -> None:
    from transformers import Trainer

    with pytest.raises(ValueError, match="not one of"):
        _trainer(tmp_path, llama(), "causal_lm", exact="causal")
    with pytest.raises(ValueError, match="pass loss='causal_lm'"):
        _trainer(tmp_path, llama(), "causal_lm", exact="token")
    with pytest.raises(ValueError, match="pass loss='sample'"):
        _trainer(tmp_path, bert("classification"), "classification", exact="token")
    for old, new in (("masked_lm", "token"), ("classification", "sample")):
        # an earlier release's name: still the same loss, with a warning naming the new one;
        # on a causal LM both then fit no head, and the error names the loss that does
        with (
            pytest.warns(
                DeprecationWarning, match=f"loss='{old}' is deprecated: it is now loss='{new}'"
            ),
            pytest.raises(ValueError, match="pass loss="),
        ):
            _trainer(tmp_path, llama(), "causal_lm", exact=old)
    with pytest.raises(ValueError, match="compute_loss_func"):
        _trainer(tmp_path, llama(), "causal_lm", exact="causal_lm", compute_loss_func=print)
    args = training_args(str(tmp_path), k=2, batch=2, label_smoothing_factor=0.1)
    with pytest.raises(ValueError, match=r"label_smoothing_factor=0\.1"):
        fbhf.ExactTrainer(model=llama(), args=args, loss="causal_lm")

    class Custom(fbhf.ExactTrainer):
        def compute_loss(self, *a: Any, **k: Any) -> Any:
            return Trainer.compute_loss(self, *a, **k)

    with pytest.raises(TypeError, match="overrides compute_loss"):
        Custom(model=llama(), args=args, loss="causal_lm")


@pytest.mark.parametrize(
    ("kind", "loss", "match"),
    [
        ("no_labels", "causal_lm", "no 'labels'"),
        ("classification", "causal_lm", "needs token labels"),
        ("causal_lm", lambda out, labels: (out.logits.sum(-1), 1), "0-dim tensor"),
        ("causal_lm", lambda out, labels: (out.logits.sum(), -1), "finite and >= 0"),
    ],
)
def test_refused_batches(tmp_path: Any, rows: list[Any], kind: str, loss: Any, match: str) -> None:
    trainer = _trainer(tmp_path, llama(), kind, exact=loss, train_dataset=rows[:8])
    with pytest.raises(ValueError, match=match):
        trainer.train()


def test_classification_loss_refuses_token_labels(tmp_path: Any, rows: list[Any]) -> None:
    from fullbatch.hf._trainer import _kind_loss

    logits = torch.zeros(2, 5, 7)
    with pytest.raises(ValueError, match="one label per row"):
        _kind_loss("sample", {"logits": logits}, torch.zeros(2, 5, dtype=torch.long), False)


def test_ddp_two_ranks_equal_full_batch() -> None:
    """Two gloo ranks, K=2 micro-batches of 4 rows each per window: every rank's parameters
    after every step equal the full batch over both ranks' rows (windows of 16, 16, 8 rows;
    the ranks hold different numbers of tokens), with average_tokens_across_devices True or
    False. The stock Trainer is exact only with it True."""
    n_rows, k = 40, 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = values(run_ranks(ddp_rank, 2, k, 4, n_rows, deadline=150.0))
    rows = text_rows(n_rows)
    seen = [r[("exact", True)]["seen"] for r in results]
    per_rank = [
        [[i for micro in s[w : w + k] for i in micro] for w in range(0, len(s), k)] for s in seen
    ]
    windows = [[rows[i] for i in a + b] for a, b in zip(*per_rank, strict=True)]
    assert [len(w) for w in windows] == [16, 16, 8]
    assert sorted(i for w in per_rank[0] + per_rank[1] for i in w) == list(range(n_rows))
    tokens = [[sum(len(rows[i]["input_ids"]) for i in w) for w in rank] for rank in per_rank]
    assert all(a != b for a, b in zip(*tokens, strict=True)), tokens  # uneven across ranks
    ref = torch_reference(llama, windows, "causal_lm")
    start = llama()
    for rank, result in enumerate(results):
        for (recipe, average), run_ in result.items():
            assert [m for m in run_["seen"]] == seen[rank]  # the same rows in every run
            errors = step_errors(run_, ref, start)
            if recipe == "exact":
                assert max(errors) < LLAMA_TOL, (rank, average, errors)
                _losses_close(run_["losses"], ref["losses"])
            elif not STOCK_AS_ON_CI:
                continue
            elif average:  # the stock Trainer, exact up to its float32 loss
                assert max(errors) < 1e-6, (rank, errors)
            else:  # per-rank token counts, averaged by DDP: the step is off
                assert min(errors) > 1e-3, (rank, errors)


def test_shift_labels_are_used_as_given(tmp_path: Any, rows: list[Any]) -> None:
    """Labels already shifted by the collator (``shift_labels``) are not shifted again."""

    class Shifted(Collator):
        def __call__(self, batch_rows: list[Any]) -> dict[str, torch.Tensor]:
            batch = super().__call__(batch_rows)
            labels = batch["labels"]
            pad = torch.full_like(labels[:, :1], -100)
            batch["shift_labels"] = torch.cat([labels[:, 1:], pad], 1)
            batch["labels"] = torch.full_like(labels, 7)  # must not be read
            return batch

    ref = torch_reference(llama, windows_of(rows[:16], 16), "causal_lm")
    trainer = fbhf.ExactTrainer(
        model=llama(),
        args=training_args(str(tmp_path), k=4, batch=4),
        train_dataset=rows[:16],
        data_collator=Shifted("causal_lm"),
        loss="causal_lm",
    )
    in_order(trainer).train()
    got = {"steps": [{n: p.detach() for n, p in trainer.model.named_parameters()}]}
    assert max(step_errors(got, ref, llama())) < LLAMA_TOL


def test_training_step_outside_a_window(tmp_path: Any, rows: list[Any]) -> None:
    trainer = _trainer(tmp_path, llama(), "causal_lm", exact="causal_lm")
    micro = Collator("causal_lm")(rows[:2])
    with pytest.raises(RuntimeError, match="outside a window"):
        trainer.training_step(trainer.model, micro)
    batches, _ = trainer.get_batch_samples(iter([micro, micro]), 2, trainer.args.device)
    trainer.accelerator.gradient_state._set_sync_gradients(True)  # the loop would say False
    with pytest.raises(RuntimeError, match="disagree"):
        trainer.training_step(trainer.model, batches[0])


def test_check_trainer_removes_unused_columns(tmp_path: Any) -> None:
    """As the Trainer's loader does: a column the model does not take (``text``) is dropped."""
    g = torch.Generator().manual_seed(0)
    rows = [
        {"input_ids": torch.randint(1, 200, (5,), generator=g), "labels": i % 3, "text": "x"}
        for i in range(8)
    ]
    args = training_args(str(tmp_path), k=4, batch=2, remove_unused_columns=True)
    model = bert("classification")
    trainer = fbhf.ExactTrainer(model=model, args=args, train_dataset=rows, loss="sample")
    check = fbhf.check_trainer(trainer)
    assert check.passed, str(check)
    assert check.rows == 8 and check.micro_batches == 4


def test_import_error_names_the_extra() -> None:
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import fullbatch\n"
        "try:\n    import fullbatch.hf\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert 'pip install "fullbatch[hf]"' in out.stdout, out.stderr


def test_check_trainer_tolerance(tmp_path: Any, rows: list[Any]) -> None:
    """float32: within 4x its measured rounding band (the full batch with rows reordered), not
    within a float64 tolerance given as ``rtol``."""
    trainer = _trainer(tmp_path, llama(torch.float32), "causal_lm", exact="causal_lm")
    default = fbhf.check_trainer(trainer, rows)
    floor = 16 * torch.finfo(torch.float32).eps
    assert default.passed and default.dtype == "float32", str(default)
    assert 0 < default.band < 1e-5 and default.tolerance == max(4 * default.band, floor)
    strict = fbhf.check_trainer(trainer, rows, rtol=F64_TOL)
    assert not strict.passed and strict.accumulated.global_rel_error > F64_TOL

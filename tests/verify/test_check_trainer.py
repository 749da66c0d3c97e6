"""fullbatch.hf.check_trainer cannot mislead: no pass on a missing gradient, a copy that shares
nothing with the user's model (whatever TRL patched onto it), nothing of the user's touched, a
tolerance from the measured rounding band (no false FAIL on float32 internals), the right fix."""

from __future__ import annotations

import random
import tempfile
import types
import warnings
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import fullbatch.hf as fbhf
from _hf_cases import SmallCollator, small_rows, training_args
from fullbatch._demo._trl_tiny import has_gemma4, tiny_causal_lm

needs_gemma4 = pytest.mark.skipif(
    not has_gemma4(), reason="Gemma 4 is not in this transformers (it is in 5.x)"
)

_REGISTRY: dict[str, Any] = {}  # a global: what no copy of a closure can reach


def _trainer(model: Any, tmp: str, *, exact: bool, cls: Any = None, **kw: Any) -> Any:
    from transformers import Trainer

    args = training_args(tmp, k=4, batch=2)
    common = dict(model=model, args=args, data_collator=SmallCollator("causal_lm"), **kw)
    if exact:
        return fbhf.ExactTrainer(**common, loss="causal_lm")
    return (cls or Trainer)(**common)


def test_no_gradient_never_passes(tmp_path: Any) -> None:
    """A Trainer whose loss does not depend on the parameters: every gradient is zero, the
    accumulated and full-batch norms are both 0; FAILED, and why."""
    from transformers import Trainer

    class Zero(Trainer):
        def compute_loss(self, model: Any, inputs: Any, *a: Any, **k: Any) -> Any:
            return 0 * super().compute_loss(model, inputs, *a, **k)

    trainer = _trainer(tiny_causal_lm("llama"), str(tmp_path), exact=False, cls=Zero)
    check = fbhf.check_trainer(trainer, small_rows(8))
    assert check.accumulated.grad_norm == 0 and check.full_batch_grad_norm == 0
    assert not check.passed and "no gradient reached" in check.reason, str(check)


@needs_gemma4
def test_float32_internals_pass_within_the_measured_band(tmp_path: Any) -> None:
    """The false FAILs of a dtype-derived tolerance: float64 models computing partly in float32
    (TRL's fused LM head on Llama: stock SFTTrainer; Gemma 4's float32 attention, whose kernel
    changes with the sequence length: ExactTrainer). Both are exact up to that rounding, which
    a float64 tolerance (1e-10) would have failed."""
    pytest.importorskip("trl")
    from trl import SFTTrainer

    from _trl_cases import config, dataset
    from fullbatch._demo._trl_tiny import char_tokenizer

    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sft = SFTTrainer(
            model=tiny_causal_lm("llama"),
            args=config(tmp, k=4, batch=2),
            train_dataset=dataset("prompt", 8),
            processing_class=char_tokenizer(),
        )
        checks = [fbhf.check_trainer(sft)]
    exact = _trainer(tiny_causal_lm("gemma4"), str(tmp_path), exact=True)
    checks.append(fbhf.check_trainer(exact, small_rows(8)))
    for check in checks:
        assert check.passed, str(check)
        assert check.accumulated.global_rel_error > 1e-10  # above float64 rounding
        assert 0 < check.band < 1e-6 and check.tolerance == 4 * check.band


@needs_gemma4
def test_gemma4_exact_trainer_passes_and_stock_names_the_fix(tmp_path: Any) -> None:
    rows = small_rows(8)
    exact = fbhf.check_trainer(_trainer(tiny_causal_lm("gemma4"), str(tmp_path), exact=True), rows)
    assert exact.passed and exact.accumulated.grad_norm > 0, str(exact)
    stock = fbhf.check_trainer(_trainer(tiny_causal_lm("gemma4"), str(tmp_path), exact=False), rows)
    assert not stock.passed and stock.accumulated.global_rel_error > 1e-3, str(stock)
    assert "fullbatch.hf.ExactTrainer(..., loss=...)" in stock.reason


def test_trl_patched_model_is_checked_on_its_copy_and_left_untouched() -> None:
    """TRL patches a fused LM head onto the model (a closure over the original): the check
    still gets a gradient (no "0 vs 0" pass) and leaves the user's model, gradients, RNG
    streams, optimizer and the Trainer's metrics as they were."""
    pytest.importorskip("trl")
    from trl import SFTTrainer

    from _trl_cases import config, dataset
    from fullbatch._demo._trl_tiny import char_tokenizer

    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = SFTTrainer(
            model=tiny_causal_lm("llama"),
            args=config(tmp, k=4, batch=1),
            train_dataset=dataset("prompt", 4),
            processing_class=char_tokenizer(),
        )
    model = trainer.model
    assert "forward" in vars(model)  # TRL's patch
    optimizer = trainer.create_optimizer()
    params = dict(model.named_parameters())
    params["lm_head.weight"].grad = torch.ones_like(params["lm_head.weight"])
    optimizer.step()  # some optimizer state to keep
    before = {n: p.detach().clone() for n, p in params.items()}
    grad = params["lm_head.weight"].grad
    state = {k: v.clone() if torch.is_tensor(v) else v for k, v in optimizer.state_dict().items()}
    trainer._metrics["train"]["entropy"].append(1.5)
    metrics = {k: list(v) for k, v in trainer._metrics["train"].items()}
    objects = (trainer._metrics, trainer.args, trainer.state)
    torch.manual_seed(3)
    random.seed(3)
    expected = (torch.rand(2), random.random())
    torch.manual_seed(3)
    random.seed(3)

    check = fbhf.check_trainer(trainer)

    assert check.passed and check.accumulated.grad_norm > 0, str(check)
    assert (torch.rand(2), random.random())[1] == expected[1]
    for n, p in params.items():
        assert torch.equal(p, before[n]), n
        assert p.grad is (grad if n == "lm_head.weight" else None), n
    assert torch.equal(grad, torch.ones_like(grad))
    assert str(optimizer.state_dict()) == str(state)
    assert {k: list(v) for k, v in trainer._metrics["train"].items()} == metrics
    assert (trainer._metrics, trainer.args, trainer.state) == objects  # the same objects
    now = (trainer._metrics, trainer.args, trainer.state)
    assert all(a is b for a, b in zip(now, objects, strict=True))


def test_a_copy_that_runs_the_original_is_an_error(tmp_path: Any) -> None:
    """A forward that reaches the original model through a global (not a closure the copy can
    rebuild) would make the check compare nothing: RuntimeError, gradients restored."""
    model = tiny_causal_lm("llama")
    _REGISTRY["model"] = model
    model.forward = types.MethodType(
        lambda self, *a, **k: type(self).forward(_REGISTRY["model"], *a, **k), model
    )
    trainer = _trainer(model, str(tmp_path), exact=True)
    try:
        with pytest.raises(RuntimeError, match="ran the model itself"):
            fbhf.check_trainer(trainer, small_rows(8))
    finally:
        _REGISTRY.clear()
    assert all(p.grad is None for p in model.parameters())


@needs_gemma4
def test_subclass_with_compute_loss_is_told_the_mixin(tmp_path: Any) -> None:
    from transformers import Trainer

    class Weighted(Trainer):
        def compute_loss(self, model: Any, inputs: Any, *a: Any, **k: Any) -> Any:
            return 2 * super().compute_loss(model, inputs, *a, **k)

    trainer = Weighted(
        model=tiny_causal_lm("gemma4"),
        args=training_args(str(tmp_path), k=4, batch=2),
        data_collator=SmallCollator("causal_lm"),
    )
    check = fbhf.check_trainer(trainer, small_rows(8))
    assert not check.passed
    assert "class Exact(fullbatch.hf.ExactTrainer, Weighted)" in check.reason, check.reason

"""fullbatch.trl.ExactDPOTrainer against a plain full batch written in the test (float64 tiny
Llama; TRL's fused head computes in float32, so steps are held to 2e-6 relative to the
reference step, taken from the same parameters)."""

from __future__ import annotations

import inspect
import tempfile
from typing import Any

import pytest
import torch

pytest.importorskip("trl")

from _trl_cases import starts, step_errors, windows
from _trl_dpo_cases import dpo_config, dpo_reference, pairs, run_dpo
from fullbatch._demo._trl_tiny import char_tokenizer, tiny_causal_lm

TOL = 2e-6
RPO = {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]}


@pytest.mark.parametrize(("k", "batch"), [(4, 1), (2, 2)])
def test_sigmoid_plus_sft_every_step_equals_full_batch(k: int, batch: int) -> None:
    """The RPO recipe: the preference term by the window's pairs, the SFT term by its chosen
    tokens; 10 pairs: the last window partial. Logged loss and rewards: the window's."""
    got = run_dpo(10, k=k, batch=batch, exact=True, **RPO)
    wins = windows(got["seen"], k)
    before = starts("llama", got["steps"])
    ref = dpo_reference(wins, before, (1.0, 0.5))
    assert max(step_errors(got["steps"], ref["steps"], before)) < TOL
    for log, m in zip(got["logs"], ref["metrics"], strict=True):
        for key in ("loss", "rewards/chosen", "rewards/margins"):
            assert abs(log[key] - m[key]) <= 1e-6 * abs(m[key]) + 1e-9, (key, log, m)
    stock = run_dpo(10, k=k, batch=batch, exact=False, **RPO)
    stock_ref = dpo_reference(windows(stock["seen"], k), starts("llama", stock["steps"]), (1, 0.5))
    errors = step_errors(stock["steps"], stock_ref["steps"], starts("llama", stock["steps"]))
    assert max(errors) > 1e-3  # TRL's own: a micro-batch mean divided by K


def test_signature_and_refusals() -> None:
    from trl import DPOTrainer

    from fullbatch.trl import ExactDPOTrainer

    assert inspect.signature(ExactDPOTrainer) == inspect.signature(DPOTrainer)
    for options, match in [
        ({"loss_type": ["aot"]}, r"loss_type=\['aot'\]"),
        ({"padding_free": True}, "padding_free=True"),
    ]:
        model = tiny_causal_lm("llama")
        with tempfile.TemporaryDirectory() as tmp, pytest.raises(ValueError, match=match):
            ExactDPOTrainer(
                model=model,
                ref_model=tiny_causal_lm("llama"),
                args=dpo_config(tmp, k=2, batch=1, **options),
                train_dataset=pairs(4),
                processing_class=char_tokenizer(),
            )
        assert "forward" not in vars(model)


def test_check_trainer_on_other_pair_losses() -> None:
    """Every pair-level loss TRL offers is exact by the window's pairs (the built-in check,
    which compares the accumulated window with the full batch on the configured trainer)."""
    import warnings

    import fullbatch.hf as fbhf
    from fullbatch.trl import ExactDPOTrainer

    for loss_type in (["hinge"], ["ipo"], ["apo_zero"], ["sigmoid_norm"]):
        with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer: Any = ExactDPOTrainer(
                model=tiny_causal_lm("llama"),
                ref_model=tiny_causal_lm("llama"),
                args=dpo_config(tmp, k=4, batch=1, loss_type=loss_type),
                train_dataset=pairs(4),
                processing_class=char_tokenizer(),
            )
            check = fbhf.check_trainer(trainer)
        assert check.passed and check.accumulated.grad_norm > 0, (loss_type, str(check))


def test_config_built_model_without_ref_model_is_refused_with_the_fix() -> None:
    """TRL reloads the reference from ``model.config._name_or_path``, empty for a model built
    from a config: stock TRL fails inside transformers (an OSError about a repo id);
    ExactDPOTrainer raises its own ValueError naming the fixes, before TRL patches the model."""
    import copy
    import warnings

    from trl import DPOTrainer

    from fullbatch.trl import ExactDPOTrainer

    model = tiny_causal_lm("llama")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(OSError, match=r"[Rr]epo"):  # what a user of stock TRL sees
            DPOTrainer(
                model=tiny_causal_lm("llama"),
                args=dpo_config(tmp, k=2, batch=1),
                train_dataset=pairs(4),
                processing_class=char_tokenizer(),
            )
        with pytest.raises(ValueError, match=r"ref_model=copy\.deepcopy\(model\)") as err:
            ExactDPOTrainer(
                model=model,
                args=dpo_config(tmp, k=2, batch=1),
                train_dataset=pairs(4),
                processing_class=char_tokenizer(),
            )
        assert "precompute_ref_log_probs=True" in str(err.value)
        assert "_name_or_path" in str(err.value)
        assert "forward" not in vars(model)
        for n, p in model.named_parameters():
            assert torch.equal(p, before[n]), n
        # the nearest correct form: a copy of the initial weights as the reference
        trainer: Any = ExactDPOTrainer(
            model=model,
            ref_model=copy.deepcopy(model),
            args=dpo_config(tmp, k=2, batch=1),
            train_dataset=pairs(4),
            processing_class=char_tokenizer(),
        )
        assert trainer.ref_model is not None


def test_precomputed_reference_without_ref_model_equals_full_batch() -> None:
    """The other documented fix, ``precompute_ref_log_probs=True`` on a config-built model with
    no ``ref_model``: the reference is the model before training, every step exact."""
    got = run_dpo(6, k=2, batch=1, exact=True, ref=False, precompute_ref_log_probs=True)
    wins = windows(got["seen"], 2)
    before = starts("llama", got["steps"])
    ref = dpo_reference(wins, before, (1.0, 0.0))
    assert len(got["steps"]) == 3
    assert max(step_errors(got["steps"], ref["steps"], before)) < TOL

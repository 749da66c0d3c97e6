"""fullbatch.trl on a transformers MoE model: ``ExactSFTTrainer``'s step is the full batch's,
the window's token-mean cross-entropy plus ``router_aux_loss_coef`` times transformers' pooled
load-balancing loss over the whole window (all micro-batches, all ranks; docs/moe.md), written
here in plain float64 PyTorch; the stock ``trl.SFTTrainer`` adds each micro-batch's own aux
term and is measurably off (``ExactDPOTrainer``: tests/integrations/test_trl_dpo_moe.py;
``ExactGRPOTrainer`` takes it over the window too, its steps: tests/integrations/test_trl_grpo.py).

The models are float64, but TRL's fused LM head accumulates its logits in float32: TRL's own
full batch (``SFTTrainer``, all rows in one micro-batch) is about 1e-7 off the float64
reference (``benchmarks/moe_trainers.py``), so steps are held to ``TOL`` = 1e-6; the stock step
and the step without the aux term are percents off there, so the check sees the aux term. The
logged ``aux_loss`` (no float32 inside) is held to 1e-9."""

from __future__ import annotations

import contextlib
import copy
import tempfile
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("trl")

from _dist import run_ranks, values
from _moe_cases import COEF, FAMILIES, VOCAB, aux64, forward, make_moe, moe_rows, rel_err
from _trl_moe_cases import sft_rank, sft_step

LENGTHS = (7, 3, 5, 7, 2, 6, 4)  # real tokens per row; micro-batches of 2, 2, 2 and 1 rows
TOL = 1e-6


def _full_batch(model: Any, rows: dict[str, torch.Tensor]) -> tuple[list[torch.Tensor], float]:
    """One forward of the whole window: the cross-entropy *summed* over its target tokens plus
    ``n · coef · aux`` (the load-balancing loss of the whole window), backpropagated, divided
    by the ``n`` targets (the token mean's gradient, rounded as ExactSFTTrainer rounds it); the
    gradient and the window's aux value."""
    out = forward(model, rows)
    labels = rows["labels"][:, 1:]
    n = int((labels != -100).sum())
    logits = out.logits[:, :-1].reshape(-1, VOCAB)
    ce = F.cross_entropy(logits, labels.reshape(-1), ignore_index=-100, reduction="sum")
    aux = aux64(out.router_logits, rows["attention_mask"])
    (ce + n * COEF * aux).backward()
    grads = [torch.zeros_like(p) if p.grad is None else p.grad / n for p in model.parameters()]
    return grads, aux.item()


@pytest.mark.parametrize("family", FAMILIES)
def test_exact_sft_moe_step_equals_full_batch(family: str) -> None:
    """Four uneven micro-batches (2, 2, 2, 1 rows, padded): the step equals the full batch's;
    the logged aux_loss is the window's load-balancing loss."""
    from fullbatch.trl import ExactSFTTrainer

    model = make_moe(family)  # output_router_logits off: TRL turns it on for the coef
    want, aux = _full_batch(copy.deepcopy(model), moe_rows(LENGTHS, seed=1))
    with tempfile.TemporaryDirectory() as out:
        got, trainer = sft_step(model, ExactSFTTrainer, out, LENGTHS, 4)
    assert rel_err(got, want) < TOL, rel_err(got, want)
    logged = [h["aux_loss"] for h in trainer.state.log_history if "aux_loss" in h]
    assert len(logged) == 1 and abs(logged[0] - aux) < 1e-9 * aux, (logged, aux)


def test_stock_sft_moe_step_is_off() -> None:
    """The control: TRL's SFTTrainer adds each micro-batch's own load-balancing loss."""
    from trl import SFTTrainer

    model = make_moe("mixtral")
    want, _ = _full_batch(copy.deepcopy(model), moe_rows(LENGTHS, seed=1))
    with tempfile.TemporaryDirectory() as out:
        got, _ = sft_step(model, SFTTrainer, out, LENGTHS, 4)
    assert rel_err(got, want) > 1e-3, rel_err(got, want)


def test_exact_sft_moe_two_ddp_ranks() -> None:
    """Two gloo ranks, 2 micro-batches each of uneven rows: the routing counts and the token
    count are the window's over both ranks; every rank's step equals the full batch's."""
    lengths = (7, 3, 5, 7, 2, 6, 4, 1)
    want, aux = _full_batch(make_moe("mixtral"), moe_rows(lengths, seed=1))
    got = values(run_ranks(sft_rank, 2, "mixtral", lengths, pg_timeout=60.0, deadline=200.0))
    for rank, result in enumerate(got):
        assert rel_err(result["update"], want) < TOL, (rank, rel_err(result["update"], want))
        assert abs(result["aux_loss"][0] - aux) < 1e-9 * aux, (rank, result["aux_loss"], aux)


def test_exact_sft_moe_without_aux_is_plain(tmp_path: Any) -> None:
    """``router_aux_loss_coef=0.0`` in the SFTConfig turns the aux loss off (TRL's rule): the
    step is the window's token-mean cross-entropy alone."""
    from fullbatch.trl import ExactSFTTrainer

    model = make_moe("olmoe")
    rows = moe_rows(LENGTHS, seed=1)
    ref = copy.deepcopy(model)
    out = forward(ref, rows)
    labels = rows["labels"][:, 1:]
    F.cross_entropy(
        out.logits[:, :-1].reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100
    ).backward()
    want = [torch.zeros_like(p) if p.grad is None else p.grad for p in ref.parameters()]
    got, trainer = sft_step(
        model, ExactSFTTrainer, str(tmp_path), LENGTHS, 4, router_aux_loss_coef=0.0
    )
    assert trainer._fb_routing is None
    assert rel_err(got, want) < TOL, rel_err(got, want)


def _grpo(tmp_path: Any, coef: float, model: Any = None) -> Any:
    from trl import GRPOConfig

    import _grpo_cases as grpo
    from fullbatch.trl import ExactGRPOTrainer

    args = GRPOConfig(
        str(tmp_path), use_cpu=True, bf16=False, report_to=[], router_aux_loss_coef=coef,
        per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
    )  # fmt: skip
    return ExactGRPOTrainer(
        model=grpo.policy(0, "mixtral") if model is None else model,
        reward_funcs=grpo.reward,
        args=args,
        train_dataset=grpo.dataset(),
        processing_class=grpo.tokenizer(),
    )


def test_grpo_takes_its_router_loss_over_the_window(tmp_path: Any) -> None:
    """ExactGRPOTrainer takes TRL's router loss over the window (tests/integrations/
    test_trl_grpo.py checks the steps): it builds without a fullbatch warning, with the
    coefficient and experts per token it will use; with ``router_aux_loss_coef=0.0`` it takes
    none, as TRL."""
    from conftest import from_fullbatch
    from fullbatch._base._moe import MoeAux

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _grpo(tmp_path, 0.1)
    assert not [w for w in caught if from_fullbatch(w.filename)], caught
    assert trainer.aux_loss_enabled and trainer._fb_aux == MoeAux(0.1, 2)
    off = _grpo(tmp_path, 0.0)
    assert not off.aux_loss_enabled and off._fb_aux is None


def test_grpo_refuses_a_router_loss_it_cannot_take_over_the_window(tmp_path: Any) -> None:
    """A config without an int ``num_experts_per_tok`` is refused at construction, and a
    micro-batch with image inputs before the pre-pass runs a forward, each naming the value
    and the fix (``router_aux_loss_coef=0.0``)."""
    import _grpo_cases as grpo
    from fullbatch._base._moe import MoeAux
    from fullbatch.trl._grpo_moe import grpo_routing

    model = grpo.policy(0, "mixtral")
    model.config.__dict__["num_experts_per_tok"] = None  # a custom config (transformers' check)
    with pytest.raises(ValueError, match=r"num_experts_per_tok=None.*router_aux_loss_coef=0\.0"):
        _grpo(tmp_path, 0.1, model)
    ids = torch.ones(2, 3, dtype=torch.long)
    micro = {"prompt_ids": ids, "prompt_mask": ids, "completion_ids": ids, "completion_mask": ids}
    micro["pixel_values"] = torch.zeros(2, 3, 4, 4)

    def no_forward(**kwargs: Any) -> Any:
        raise AssertionError("the pre-pass ran a forward")

    with pytest.raises(ValueError, match=r"\['pixel_values'\].*router_aux_loss_coef=0\.0"):
        grpo_routing(MoeAux(0.1, 2), no_forward, [micro], None, contextlib.nullcontext())  # type: ignore[arg-type]


def test_check_trainer_judges_the_moe_aux_loss(tmp_path: Any) -> None:
    """``fullbatch.hf.check_trainer`` on a MoE trainer: its full batch includes the whole
    window's load-balancing loss, and its rounding band pads the micro-batches without filler
    rows (a filler row would be routed and move the aux loss by 4%, which once let the stock
    trainer pass): ExactSFTTrainer passes, the stock SFTTrainer fails, naming the aux loss."""
    from trl import SFTTrainer

    import fullbatch.hf as fbhf
    from _trl_moe_cases import sft_trainer
    from fullbatch.trl import ExactSFTTrainer

    lengths = (7, 3, 5, 7, 2, 6)
    exact = fbhf.check_trainer(sft_trainer(ExactSFTTrainer, str(tmp_path), lengths, 3))
    assert exact.passed and exact.band < 1e-6, exact
    assert any("load-balancing" in n for n in exact.notes), exact.notes
    stock = fbhf.check_trainer(sft_trainer(SFTTrainer, str(tmp_path), lengths, 3))
    assert not stock.passed and stock.band < 1e-6, stock
    assert stock.accumulated.global_rel_error > 1e-2, stock
    assert "MoE load-balancing loss is each micro-batch's" in stock.reason, stock.reason


def _mixtral100() -> Any:
    """A tiny float64 Mixtral with the character tokenizer's vocabulary (100 ids)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=100, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
        num_experts_per_tok=2, router_aux_loss_coef=0.25, max_position_embeddings=64,
        experts_implementation="eager", pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )  # fmt: skip
    return transformers.MixtralForCausalLM(config).double()


@pytest.mark.parametrize("options", [{}, {"packing": True, "max_length": 24}])
def test_trl_data_pipeline_on_moe(tmp_path: Any, options: dict[str, Any]) -> None:
    """TRL's own pipeline (prompt-completion rows it tokenizes, completion-only loss; and BFD
    packing, padding-free: no attention_mask, every packed token routed): check_trainer holds
    ExactSFTTrainer's window to the full batch, aux loss included, and fails the stock one."""
    from trl import SFTTrainer

    import fullbatch.hf as fbhf
    from _trl_cases import config, dataset
    from fullbatch._demo._trl_tiny import char_tokenizer
    from fullbatch.trl import ExactSFTTrainer

    for cls, passes in ((ExactSFTTrainer, True), (SFTTrainer, False)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = cls(
                model=_mixtral100(),
                args=config(str(tmp_path), k=2, batch=2, **options),
                train_dataset=dataset("prompt", 8),
                processing_class=char_tokenizer(),
            )
            check = fbhf.check_trainer(trainer)
        assert trainer.aux_loss_enabled and check.band < 1e-6, check
        assert check.passed is passes, check
        if not passes:
            assert check.accumulated.global_rel_error > 1e-3, check


def test_exact_sft_moe_warns_when_the_counts_disagree(tmp_path: Any) -> None:
    """The pre-pass weights the aux term by the targets it counts (``exact_count``); a fused
    head that counts otherwise (prompt-learning PEFT's virtual tokens) would mis-weight it:
    warned, naming both counts and the fix."""
    from fullbatch.trl import ExactSFTTrainer

    class OffByOne(ExactSFTTrainer):
        def exact_count(self, inputs: dict[str, Any]) -> Any:
            return super().exact_count(inputs) + 1

    n = int((moe_rows(LENGTHS, seed=1)["labels"][:, 1:] != -100).sum())
    counted = rf"pre-pass counted {n + 4} target tokens but the fused head {n}:"  # 4 micro-batches
    with pytest.warns(UserWarning, match=counted):
        sft_step(make_moe("mixtral"), OffByOne, str(tmp_path), LENGTHS, 4, quiet=False)

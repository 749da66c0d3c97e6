"""fullbatch.hf.ExactTrainer with a DeepSpeed config (the Trainer's DeepSpeed integration),
1 and 2 gloo ranks on CPU, float32: every rank's parameters after every step equal a plain
PyTorch full batch over the window's rows (tests/_hf_cases.py ``torch_reference``) at ZeRO 0,
2 and 3, with and without CPU offload, for a causal LM and a BERT masked-LM head; the stock
Trainer on the same BERT config is 3x off, and with ``gradient_clipping`` left out of the
config DeepSpeed clips at 1.0 (what ExactTrainer refuses, with the others it cannot make exact).
A window with a NaN loss on one rank, or without items, is skipped on every rank at ZeRO 0
and 2: parameters and learning rate unchanged, one warning, the skip counted.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("deepspeed")

import _ds_trainer_cases as cases
from _dist import one_of, several
from _dist_ds import run_ds, values
from _hf_cases import bert, llama, step_errors, text_rows, torch_reference

pytestmark = pytest.mark.timeout(600)

BAND = 2e-6  # float32 (measured: 5e-7 of the update)
RUNS = {
    1: [
        (0, False, "causal_lm", "causal_lm", "auto"),
        (2, False, "causal_lm", "causal_lm", "auto"),
        (2, True, "causal_lm", "causal_lm", "auto"),
        (3, False, "causal_lm", "causal_lm", "auto"),
        (3, True, "causal_lm", "causal_lm", "auto"),
        (2, True, "masked_lm", "token", "auto"),
        (3, False, "masked_lm", "token", "auto"),
        (2, False, "masked_lm", None, "auto"),  # stock: the head drops num_items_in_batch
        (2, False, "causal_lm", None, None),  # stock, gradient_clipping left out
    ],
    2: [
        (0, False, "masked_lm", "token", "auto"),
        (2, True, "causal_lm", "causal_lm", "auto"),
        (3, False, "causal_lm", "causal_lm", "auto"),
        (3, True, "masked_lm", "token", "auto"),
    ],
}
ROWS = {1: 16, 2: 32}
MOE_STAGES = {1: (2,), 2: (3,)}  # a MoE model's routing pre-pass, in the same launches


def _make(kind: str) -> Any:
    return (lambda: llama().float()) if kind == "causal_lm" else (lambda: bert(kind).float())


@pytest.fixture(scope="module", params=[1, 2], ids=["1-rank", "2-ranks"])
def trained(request: Any) -> tuple[int, list[dict[Any, Any]]]:
    world = request.param
    runs = run_ds(cases.train_all, world, RUNS[world], ROWS[world], MOE_STAGES[world], deadline=500)
    return world, values(runs)


def _windows(results: list[dict[str, Any]], run: tuple[Any, ...], world: int) -> list[Any]:
    rows = text_rows(ROWS[world])
    per_rank = [
        [
            [i for m in r[run]["seen"][w : w + cases.K] for i in m]
            for w in range(0, len(r[run]["seen"]), cases.K)
        ]
        for r in results
    ]
    windows = [[rows[i] for part in parts for i in part] for parts in zip(*per_rank, strict=True)]
    assert [len(w) for w in windows] == [8 * world, 8 * world]
    return windows


def test_exact_trainer_on_deepspeed_steps_like_the_full_batch(
    trained: tuple[int, list[dict[Any, Any]]],
) -> None:
    world, results = trained
    for run in RUNS[world]:
        _stage, _offload, kind, exact, _ = run
        if exact is None:
            continue
        ref = torch_reference(_make(kind), _windows(results, run, world), kind)
        for rank, res in enumerate(results):
            errors = step_errors(res[run], ref, _make(kind)())
            assert max(errors) < BAND, (run, rank, errors)
            assert res[run]["counters"] == (2, 0)
            assert res[run]["engine_clip"] == 0.0  # "auto" followed max_grad_norm=0
            for got, want in zip(res[run]["losses"], ref["losses"], strict=True):
                assert abs(got - want) < 1e-5 * abs(want), (run, got, want)


def test_stock_trainer_on_deepspeed(trained: tuple[int, list[dict[Any, Any]]]) -> None:
    """The BERT head ignores num_items_in_batch: 3x the full-batch update. A causal LM honours
    it, but a config without gradient_clipping makes DeepSpeed clip at its default: 1.0 since
    DeepSpeed #8068 (0.19.8), 0 (off) before (0.17.0)."""
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

    world, results = trained
    if world != 1:
        pytest.skip("the stock runs are on one rank")
    stock = RUNS[1][-2]
    ref = torch_reference(_make("masked_lm"), _windows(results, stock, 1), "masked_lm")
    assert min(step_errors(results[0][stock], ref, _make("masked_lm")())) > 1.0
    clipped = RUNS[1][-1]
    assert results[0][clipped]["engine_clip"] == GRADIENT_CLIPPING_DEFAULT
    ref = torch_reference(_make("causal_lm"), _windows(results, clipped, 1), "causal_lm")
    errors = step_errors(results[0][clipped], ref, _make("causal_lm")())
    if GRADIENT_CLIPPING_DEFAULT:
        assert min(errors) > 0.1, errors
    else:
        assert max(errors) < BAND, errors


def test_configs_that_cannot_be_exact_are_refused() -> None:
    from fullbatch.hf._deepspeed import default_clip

    (out,) = values(run_ds(cases.refusals, 1, deadline=200))
    assert "fp16/bf16 gradients live in DeepSpeed's own" in out["stage0_bf16"], out
    if default_clip():  # 1.0 since DeepSpeed #8068; 0 (off, accepted) before
        assert "gradient_clipping=1.0 (its default: the key is absent)" in out["clip_absent"]
    else:
        assert out["clip_absent"] == "accepted", out
    assert "gradient_clipping=0.5 while max_grad_norm=1.0" in out["clip_differs"], out


SKIP_STAGES = [0, 2]


@pytest.fixture(scope="module")
def skipped() -> list[Any]:
    """Both stages of :data:`SKIP_STAGES` on one launch of 2 ranks (:func:`_dist.several`)."""
    return values(run_ds(several, 2, [(cases.skips, (s,)) for s in SKIP_STAGES], deadline=550))


@pytest.mark.parametrize("stage", SKIP_STAGES)
def test_non_finite_and_empty_windows_are_skipped(stage: int, skipped: list[Any]) -> None:
    """2 ranks, a linear LR schedule: the poisoned window 1 is skipped on every rank (stage 0:
    fullbatch reads the gradients before DeepSpeed's step and clears them; ZeRO 2: the NaN
    scale makes DeepSpeed's overflow check skip; no items: nothing backpropagated), parameters
    exactly as after window 0, the LR schedule not advanced (the Trainer steps it after every
    window: kept and put back), one warning, 2 steps and 1 skip counted; window 2 steps."""
    results = one_of(skipped, SKIP_STAGES.index(stage))
    reasons = {"nan": "non-finite loss", "no_items": "no items counted in the window"}
    for rank, result in enumerate(results):
        for mode, reason in reasons.items():
            r = result[mode]
            assert r["counters"] == (2, 1), (rank, mode)
            assert len(r["steps"]) == 3
            for name, value in r["steps"][1].items():
                assert torch.equal(value, r["steps"][0][name]), (rank, mode, name)
            assert any(not torch.equal(v, r["steps"][1][n]) for n, v in r["steps"][2].items())
            # the skipped window did not advance the schedule: window 2 uses window 1's LR
            assert r["lrs"][0] > r["lrs"][1] == r["lrs"][2], (rank, mode, r["lrs"])
            assert len(r["warnings"]) == 1, r["warnings"]
            assert r["warnings"][0].startswith(f"window 1 was skipped ({reason})")


def test_exact_trainer_on_deepspeed_moe_is_the_full_batch(
    trained: tuple[int, list[dict[Any, Any]]],
) -> None:
    """A tiny Mixtral with its router aux loss on, ZeRO-2 on 1 rank and ZeRO-3 on 2 (whose
    routing pre-pass gathers the partitioned parameters on every rank): every rank's step
    equals the full batch's (token-mean cross-entropy + coef · the whole window's pooled
    load-balancing loss, float64, tests/_moe_cases.py), to float32 rounding (the stock
    Trainer's per-micro-batch aux loss is more than 1e-3 off: tests/integrations/test_hf_moe.py)."""
    import copy

    from _moe_cases import make_moe, moe_rows, reference, rel_err

    world, results = trained
    model = make_moe("mixtral")
    model.config.output_router_logits = True
    want, _ = reference(copy.deepcopy(model), moe_rows(cases.MOE_LENGTHS, seed=1))
    for stage in MOE_STAGES[world]:
        for rank, res in enumerate(results):
            err = rel_err(res[("moe", stage)], want)
            assert err < BAND, (stage, rank, err)

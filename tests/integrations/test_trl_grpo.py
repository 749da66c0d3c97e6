"""``fullbatch.trl.ExactGRPOTrainer``: every optimizer step is the objective over its sequences.

Each run trains a tiny random Qwen2 policy (float64, CPU, tokenizer built in code, a reward
function in tests/_grpo_cases.py) for a few steps, records every micro-batch TRL trained on,
and compares each step's gradient with the loss type's objective computed over exactly that
step's sequences (tests/_grpo_cases.py, plain PyTorch); on a tiny Mixtral or Qwen2-MoE with
``router_aux_loss_coef``, plus that coefficient times transformers' load-balancing loss of
all the step's forwards pooled (the full batch's, docs/moe.md "GRPO"). TRL computes
log-probabilities in float32 chunks (its fused LM head), so the float64 reference agrees to
about 2e-7 relative (measured over every run below: at most 2.4e-7); TOL leaves a factor 40
above that band, and stock GRPOTrainer's normalization errors are 1e-4 to 1e-1 in the same
runs.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

pytest.importorskip("trl")

import itertools

from trl import GRPOConfig, GRPOTrainer

import _grpo_cases as cases
from conftest import from_fullbatch
from fullbatch.trl import ExactGRPOTrainer

TOL = 1e-5
# (steps_per_generation, gradient_accumulation_steps, num_iterations): a generation batch cut
# into two windows; a window spanning two generation batches; windows straddling the slices
# of a generation batch that is trained on twice.
SETTINGS = [(4, 2, 1), (2, 4, 1), (3, 2, 2)]


def _check(trainer: Any) -> list[float]:
    config = cases.settings(trainer)
    steps = trainer._recorder.steps
    errors = cases.step_errors(config, steps)
    assert len(errors) == trainer.args.max_steps
    lr = trainer.args.learning_rate
    for before, after in itertools.pairwise(steps):  # SGD used exactly those gradients
        for name, value in after["params"].items():
            expected = before["params"][name] - lr * before["grads"][name]
            assert torch.allclose(value, expected, rtol=0, atol=1e-12), name
    return errors


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "cispo", "sapo"])
@pytest.mark.parametrize(("spg", "ga", "iterations"), SETTINGS)
def test_every_step_is_the_window_objective(
    loss_type: str, spg: int, ga: int, iterations: int
) -> None:
    """With the KL term (beta) and an entropy bonus, each by its own window denominator."""
    extra = {"epsilon_high": 1.1} if loss_type == "cispo" else {}
    trainer = cases.run(
        ExactGRPOTrainer,
        loss_type=loss_type,
        steps_per_generation=spg,
        gradient_accumulation_steps=ga,
        num_iterations=iterations,
        max_steps=2,
        entropy_coef=0.05,
        beta=0.1,
        **extra,
    )
    errors = _check(trainer)
    assert max(errors) < TOL, errors
    sizes = [sum(len(m["advantages"]) for m in s["micro"]) for s in trainer._recorder.steps]
    assert sizes == [4 * ga] * 2  # each step trained on exactly its window's sequences


def test_dapo_without_extra_terms_and_stock_error() -> None:
    """Plain DAPO with a window spanning two generation batches: fullbatch is exact where
    stock TRL weighs each generation batch the same (the same harness measures both, so it
    can fail; the cut-window case is in test_two_gloo_ranks and the benchmark)."""
    kwargs = {"loss_type": "dapo", "steps_per_generation": 2, "gradient_accumulation_steps": 4}
    exact = _check(cases.run(ExactGRPOTrainer, **kwargs))
    stock = _check(cases.run(GRPOTrainer, **kwargs))
    assert max(exact) < TOL, exact
    assert min(stock) > 1e-2, stock


@pytest.mark.parametrize(
    ("moe", "loss_type", "spg", "ga"), [("mixtral", "dapo", 4, 2), ("qwen2_moe", "grpo", 2, 4)]
)
def test_moe_router_loss_is_the_windows(moe: str, loss_type: str, spg: int, ga: int) -> None:
    """A tiny Mixtral (2 layers) and Qwen2-MoE with router_aux_loss_coef=0.1, micro-batches of
    uneven completion lengths and padding: each step is the policy objective plus 0.1 times
    transformers' load-balancing loss of all the window's forwards pooled (measured 0.8e-7 to
    1.8e-7, the float32 band of TRL's fused head); TRL's own form, the mean of each
    micro-batch's load-balancing loss, is 2.2e-3 to 1.8e-2 from the same steps. The logged loss
    and aux_loss are the window's."""
    trainer = cases.run(
        ExactGRPOTrainer,
        moe=moe,
        loss_type=loss_type,
        steps_per_generation=spg,
        gradient_accumulation_steps=ga,
        router_aux_loss_coef=0.1,
        entropy_coef=0.05,
        max_steps=2,
    )
    assert trainer.aux_loss_enabled
    errors = _check(trainer)
    assert max(errors) < TOL, errors
    config = {**cases.settings(trainer), "router_window": False}
    stock_form = cases.step_errors(config, trainer._recorder.steps)
    assert min(stock_form) > 1e-3, stock_form
    _check_logs(trainer)


def test_logged_loss_and_entropy_are_the_windows() -> None:
    """The logged loss is the window objective; entropy and KL are token means over the
    window (TRL logs means of per-micro-batch means); policy_loss is the window's."""
    trainer = cases.run(
        ExactGRPOTrainer,
        loss_type="dapo",
        steps_per_generation=4,
        gradient_accumulation_steps=2,
        entropy_coef=0.05,
        beta=0.1,
        max_steps=3,
    )
    _check_logs(trainer)


def _check_logs(trainer: Any) -> None:
    config = cases.settings(trainer)
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert len(logs) == trainer.args.max_steps
    for log, step in zip(logs, trainer._recorder.steps, strict=True):
        value = cases.reference(config, step)[1]
        entropy = cases.window_entropy(step)
        assert log["loss"] == pytest.approx(value, rel=TOL, abs=1e-9)
        assert log["entropy"] == pytest.approx(entropy, rel=TOL)
        if config["beta"]:
            # KL ~ (ref - lp)^2 / 2 is built from TRL's float32 log-probabilities (2.4e-7 band):
            # measured 1.1e-8 from the reference; the mean of micro-batch means is 3e-6 off
            assert log["kl"] == pytest.approx(cases.window_kl(config, step), rel=TOL, abs=1e-7)
        if config["router"]:  # the window's load-balancing loss (float64 throughout)
            aux = cases.window_aux_value(step)
            assert log["aux_loss"] == pytest.approx(aux, rel=1e-12), (log["aux_loss"], aux)
        else:  # the policy term: the objective without the entropy bonus
            policy = value + config["entropy_coef"] * entropy
            assert abs(policy) > 1e-3  # not a check that cannot fail (GRPO's is ~0 at ratio 1)
            assert log["policy_loss"] == pytest.approx(policy, rel=TOL, abs=1e-7)


def _config(**kwargs: Any) -> GRPOConfig:
    return GRPOConfig(output_dir="unused", use_cpu=True, report_to=[], **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"loss_type": "bnpo"}, "no full-batch form.*loss_type='dapo'"),
        ({"loss_type": "luspo"}, "got loss_type='luspo'"),
        ({"top_entropy_quantile": 0.5}, "top_entropy_quantile=0.5"),
        # a config-built policy: TRL would reload the KL reference from an empty path (the
        # saved-folder form the message names is what cases.run does for beta, and is exact)
        ({"loss_type": "dapo", "beta": 0.1}, r"_name_or_path.*model\.save_pretrained\(path\)"),
    ],
)
def test_refused_at_construction(kwargs: dict[str, Any], match: str) -> None:
    model = cases.policy()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=match):
        ExactGRPOTrainer(
            model=model,
            reward_funcs=cases.reward,
            args=_config(**kwargs),
            train_dataset=cases.dataset(),
            processing_class=cases.tokenizer(),
        )
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_accepted_settings_build_without_fullbatch_warnings() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ExactGRPOTrainer(
            model=cases.policy(),
            reward_funcs=cases.reward,
            args=_config(loss_type="dapo", bf16=False),
            train_dataset=cases.dataset(),
            processing_class=cases.tokenizer(),
        )
    assert not [w for w in caught if from_fullbatch(w.filename)], caught


def test_training_step_outside_train_raises() -> None:
    trainer = ExactGRPOTrainer(
        model=cases.policy(),
        reward_funcs=cases.reward,
        args=_config(loss_type="dapo", bf16=False),
        train_dataset=cases.dataset(),
        processing_class=cases.tokenizer(),
    )
    batch = next(iter(trainer.get_train_dataloader()))
    with pytest.raises(RuntimeError, match=r"trainer\.train\(\)"):
        trainer.training_step(trainer.model, batch, None)


def test_two_gloo_ranks() -> None:
    """Two DDP ranks (gloo, CPU): every rank's gradient at every step equals the objective
    over both ranks' sequences of that step (on a tiny Mixtral, with the load-balancing loss
    of both ranks' forwards pooled); stock GRPOTrainer is off for DAPO (spg != GA)."""
    from _dist import run_ranks, values

    runs = [
        {"loss_type": "dapo", "steps_per_generation": 4, "gradient_accumulation_steps": 2},
        {
            "loss_type": "grpo",
            "steps_per_generation": 1,
            "gradient_accumulation_steps": 2,
            "entropy_coef": 0.05,
            "stock": False,
        },
        {  # the load-balancing loss of both ranks' sequences (one pre-pass reduction)
            "loss_type": "dapo",
            "moe": "mixtral",
            "router_aux_loss_coef": 0.1,
            "steps_per_generation": 2,
            "gradient_accumulation_steps": 2,
            "stock": False,
        },
    ]
    for case in runs:
        case.update(per_device_train_batch_size=2, max_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = values(run_ranks(cases.ddp_rank, 2, runs, deadline=240.0, pg_timeout=60.0))
    for index in range(len(runs)):
        for name in results[0][index]:
            ranks = [result[index][name] for result in results]
            config = ranks[0]["config"]
            errors = []
            for k in range(runs[index]["max_steps"]):
                steps = [r["steps"][k] for r in ranks]
                params = [s["params"] for s in steps]
                assert all(torch.equal(params[0][n], params[1][n]) for n in params[0])
                window = {"params": params[0], "micro": steps[0]["micro"] + steps[1]["micro"]}
                assert sum(len(m["advantages"]) for m in window["micro"]) == 8
                for step in steps:
                    errors += cases.step_errors(config, [{**window, "grads": step["grads"]}])
            if name == "ExactGRPOTrainer":
                assert max(errors) < TOL, (index, errors)
            elif index == 0:
                assert min(errors) > 1e-2, errors


def test_unknown_arguments() -> None:
    """An argument GRPOTrainer does not take raises TypeError before anything is built."""
    with pytest.raises(TypeError, match="loss"):
        ExactGRPOTrainer(model=cases.policy(), reward_funcs=cases.reward, loss="dapo")


def test_import_error_names_the_extra() -> None:
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['trl'] = None\n"
        "try:\n    import fullbatch.trl\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "pip install 'fullbatch[trl]'" in out.stdout, out.stderr


def test_a_non_finite_window_is_skipped_as_in_every_wing() -> None:
    """The one verdict with GRPO's own scales: a NaN in the second window's loss leaves the
    parameters, the optimizer (SGD with momentum) and the LR schedule as they were, warns at
    the user's line, and fullbatch counts 2 optimizer steps of 3 windows."""
    import math
    import tempfile

    from transformers import TrainerCallback

    class Poisoned(ExactGRPOTrainer):
        def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
            loss = super()._compute_loss(model, inputs)
            return loss * math.nan if self.state.global_step == 1 else loss

    snaps: list[tuple[list[torch.Tensor], Any, float]] = []

    def snap(trainer: Any) -> None:
        params = [p.detach().clone() for p in trainer.model.parameters()]
        momentum = [s["momentum_buffer"].clone() for s in trainer.optimizer.state.values()]
        snaps.append((params, momentum, trainer.lr_scheduler.get_last_lr()[0]))

    class Snap(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step > 0:
                snap(trainer)

    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(), loss_type="dapo", per_device_train_batch_size=4,
        num_generations=4, max_completion_length=6, steps_per_generation=2,
        gradient_accumulation_steps=2, max_steps=3, learning_rate=0.05,
        lr_scheduler_type="linear", optim="sgd", optim_args="momentum=0.9", use_cpu=True,
        bf16=False, report_to=[], save_strategy="no", disable_tqdm=True, logging_steps=1, seed=0,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Poisoned(
            model=cases.policy(),
            reward_funcs=cases.reward,
            args=args,
            train_dataset=cases.dataset(),
            processing_class=cases.tokenizer(),
            callbacks=[Snap()],
        )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    snap(trainer)
    assert (trainer.fb_counters.steps, trainer.fb_counters.skipped_windows) == (2, 1)
    assert trainer.state.global_step == 3  # the Trainer counts windows
    (p0, m0, lr0), (p1, m1, lr1), (p2, _, lr2) = snaps
    assert len(m0) == len(p0)  # SGD with momentum: optimizer state a step would change
    assert all(torch.equal(a, b) for a, b in zip(p0, p1, strict=True))  # untouched
    assert all(torch.equal(a, b) for a, b in zip(m0, m1, strict=True))
    assert lr1 == lr0 and lr2 < lr1  # the schedule waited for the skip, then moved on
    assert not all(torch.equal(a, b) for a, b in zip(p1, p2, strict=True))  # window 2 stepped
    assert all(bool(torch.isfinite(p).all()) for p in p2)
    skips = [w for w in caught if "was skipped" in str(w.message)]
    assert len(skips) == 1 and skips[0].filename == __file__, skips
    assert str(skips[0].message).startswith("window 1 was skipped (non-finite loss)")


@pytest.mark.parametrize("moe", ["mixtral", "qwen3_moe", "olmoe"])
def test_moe_router_term_alone_is_the_windows_in_float64(moe: str, monkeypatch: Any) -> None:
    """The aux term alone, away from TRL's float32 fused head: with one reward for every
    completion the advantages are 0, so the policy term's gradient is exactly 0 and each step's
    gradient is 0.1 times that of the window's load-balancing loss (a tiny Mixtral, Qwen3-MoE
    and OLMoE, 2 windows of 2 micro-batches of uneven padded sequences), written in float64
    here: on the Mixtral, measured 2.4e-16 and 6.0e-16 relative; TRL's mean of the
    micro-batches' losses is 4.6e-2 and 1.7e-1 away.
    The routing pre-pass ran once per window, over all its micro-batches, and its time is
    summed in ``trainer.fb_stats_seconds``."""
    from fullbatch.trl import _grpo_moe

    passes: list[int] = []
    seconds: list[float] = []
    prepass = _grpo_moe.window_routing

    def counted(*args: Any, **kwargs: Any) -> Any:
        passes.append(len(args[2]))  # the window's micro-batches
        routing = prepass(*args, **kwargs)
        seconds.append(routing.seconds)
        return routing

    monkeypatch.setattr(_grpo_moe, "window_routing", counted)
    trainer = cases.run(
        ExactGRPOTrainer,
        moe=moe,
        rewards=lambda completions, **kw: [1.0] * len(completions),
        loss_type="dapo",
        steps_per_generation=2,
        gradient_accumulation_steps=2,
        router_aux_loss_coef=0.1,
        max_steps=2,
    )
    assert passes == [2, 2]
    assert all(s > 0 for s in seconds), seconds
    assert trainer.fb_stats_seconds == pytest.approx(sum(seconds), rel=1e-12)
    for step in trainer._recorder.steps:
        masks = [m["completion_mask"] for m in step["micro"]]
        assert len({tuple(m.sum(1).tolist()) for m in masks}) > 1  # uneven completions
        model = cases.policy(moe=moe)
        model.load_state_dict(step["params"])
        routed = [cases._token_terms(model, m)[2] for m in step["micro"]]
        (0.1 * cases.window_aux(model, routed)).backward(retain_graph=True)
        want = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
        err = _rel(step["grads"], want)
        assert err < 1e-12, err
        model.zero_grad(set_to_none=True)
        (0.1 * torch.stack([r[0] for r in routed]).mean()).backward()  # TRL's form
        stock = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
        assert _rel(step["grads"], stock) > 1e-2, _rel(step["grads"], stock)


def _rel(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    num = sum(((got[k] - want[k]) ** 2).sum() for k in want)
    return float((num / sum((w**2).sum() for w in want.values())).sqrt())

"""The probe judges a stock TRL trainer under the objective that trainer trains: TRL's
``DPOTrainer`` under DPO (its own loss, summed over pairs), RIGHT where its step is the float64
full window's DPO step written here and WRONG, named, where it is not (a per-micro-batch mean
over uneven pair counts); what the probe cannot compute (KTO, DPO's ``aot``) stops the run at
its first forward, before any backward or optimizer step, in the command line's words."""

from __future__ import annotations

import copy
import json
import tempfile
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import fullbatch as fb

pytest.importorskip("trl")
from _cli_scripts import probe as cli

from _trl_cases import Recording
from _trl_dpo_cases import BETA, _logps, dpo_config, pairs
from fullbatch._demo._trl_tiny import char_tokenizer, tiny_causal_lm
from fullbatch._probe._trainer_objective import Unknown

K, BATCH = 2, 2


def _train(n: int, *, exact: bool = False, **overrides: Any) -> dict[str, Any]:
    """One window of ``K`` micro-batches of ``BATCH`` pairs from ``pairs(n)`` (the last one
    short when ``n < K * BATCH``), probed with no objective; the gradient the optimizer got."""
    from transformers import TrainerCallback
    from trl import DPOTrainer

    from fullbatch.trl import ExactDPOTrainer

    first: dict[str, Any] = {}

    class Applied(TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            first.setdefault("grads", [p.grad.clone() for p in kw["model"].parameters()])

    model = tiny_causal_lm("llama")
    start = copy.deepcopy(model)
    cls = ExactDPOTrainer if exact else DPOTrainer
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer: Any = cls(
            model=model, ref_model=tiny_causal_lm("llama"),
            args=dpo_config(tmp, k=K, batch=BATCH, max_steps=1, **overrides),
            train_dataset=pairs(n), processing_class=char_tokenizer(), callbacks=[Applied()],
        )  # fmt: skip
        recording = Recording(trainer.data_collator)
        trainer.data_collator = recording
        with fb.probe(windows=1) as probe:
            trainer.train()
    rows = [r for micro in recording.seen[:K] for r in micro]
    tokens = trainer._total_train_tokens  # counted by TRL's loss, once per micro-batch
    return {"report": probe.report, "grads": first["grads"], "start": start, "rows": rows,
            "tokens": tokens}  # fmt: skip


def _truth(start: torch.nn.Module, rows: list[dict]) -> list[torch.Tensor]:
    """The window's pairs as one float64 batch: mean over pairs of ``-log σ(β Δ)``, ``Δ`` the
    chosen minus rejected completion log-ratio to the frozen initial model; one backward."""
    model, ref = copy.deepcopy(start).double(), copy.deepcopy(start).double()
    prompts = [r["prompt_ids"] for r in rows]
    chosen, rejected = [r["chosen_ids"] for r in rows], [r["rejected_ids"] for r in rows]
    pc, _, _ = _logps(model, prompts, chosen)
    pr, _, _ = _logps(model, prompts, rejected)
    with torch.no_grad():
        rc, _, _ = _logps(ref, prompts, chosen)
        rr, _, _ = _logps(ref, prompts, rejected)
    (-F.logsigmoid(BETA * ((pc - rc) - (pr - rr)))).mean().backward()
    return [p.grad for p in model.parameters()]


def _error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    diff = sum(float((g.double() - w).square().sum()) for g, w in zip(got, want, strict=True))
    norm = sum(float(w.square().sum()) for w in want)
    return (diff / norm) ** 0.5


def test_stock_dpo_trainer_is_judged_under_dpo_and_right_when_it_is() -> None:
    run = _train(2 * K * BATCH)
    error = _error(run["grads"], _truth(run["start"], run["rows"]))
    assert error < 1e-6  # the truth (TRL's fused head rounds in float32): the step is DPO's
    report = run["report"]
    check = report.windows[0]
    assert report.ok, str(report)
    assert check.objective == "dpo"
    assert check.objective_source == "DPOTrainer (loss_type=['sigmoid'], summed over pairs)"
    assert check.error < 1e-6
    assert "steps will differ" not in check.diagnosis  # max_grad_norm=0 and inf: no clip
    # the probe ran TRL's loss again on every micro-batch, and the trainer counted nothing more
    assert run["tokens"] == sum(
        2 * len(r["prompt_ids"]) + len(r["chosen_ids"]) + len(r["rejected_ids"])
        for r in run["rows"]
    )


def test_stock_dpo_trainer_over_uneven_pair_counts_is_wrong_and_named() -> None:
    run = _train(K * BATCH - 1)  # micro-batches of 2 and 1 pairs: each its own mean
    error = _error(run["grads"], _truth(run["start"], run["rows"]))
    assert error > 1e-2  # the truth: the lone pair weighs twice
    report = run["report"]
    check = report.windows[0]
    assert not report.ok and check.objective == "dpo", str(report)
    assert check.pattern == "mean of per-micro-batch means", check.diagnosis
    assert check.error == pytest.approx(error, rel=1e-4)
    # weights 3/4 and 3/2: (1/K) / (pairs) against 1 / (window's pairs)
    assert check.weights == pytest.approx((0.75, 1.5), rel=1e-6)
    assert "fullbatch.trl.ExactDPOTrainer" in check.diagnosis


def test_exact_dpo_trainer_over_uneven_pair_counts_is_right() -> None:
    run = _train(K * BATCH - 1, exact=True)
    error = _error(run["grads"], _truth(run["start"], run["rows"]))
    assert error < 1e-6
    check = run["report"].windows[0]
    assert run["report"].ok and check.objective == "dpo", str(run["report"])
    assert check.objective_source.startswith("fullbatch.trl.ExactDPOTrainer (loss_type=")


def test_dpo_loss_with_no_per_pair_sum_stops_before_any_backward() -> None:
    from trl import DPOTrainer

    model = tiny_causal_lm("llama")
    before = [p.detach().clone() for p in model.parameters()]
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = DPOTrainer(
            model=model, ref_model=tiny_causal_lm("llama"), train_dataset=pairs(4),
            args=dpo_config(tmp, k=K, batch=BATCH, max_steps=1, loss_type=["aot"]),
            processing_class=char_tokenizer(),
        )  # fmt: skip
        with pytest.raises(Unknown, match=r"cannot infer the objective for DPOTrainer: "
                           r"DPOTrainer with loss_type=\['aot'\] sorts the pairs"):  # fmt: skip
            with fb.probe(windows=1):
                trainer.train()
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


# -- the command line ---------------------------------------------------------------------------

_COMMON = """
import sys, tempfile, warnings
sys.path.insert(0, {tests!r})
from transformers import TrainerCallback
from fullbatch._demo._trl_tiny import char_tokenizer, tiny_causal_lm
warnings.simplefilter("ignore")

class Said(TrainerCallback):
    def on_optimizer_step(self, args, state, control, **kw):
        print("optimizer step", flush=True)
"""

DPO_SCRIPT = """
from trl import DPOTrainer
from _trl_dpo_cases import dpo_config, pairs
with tempfile.TemporaryDirectory() as tmp:
    DPOTrainer(model=tiny_causal_lm("llama"), ref_model=tiny_causal_lm("llama"),
               args=dpo_config(tmp, k=2, batch=2, max_steps=1), train_dataset=pairs(4),
               processing_class=char_tokenizer(), callbacks=[Said()]).train()
print("script finished", flush=True)
"""

KTO_SCRIPT = """
from datasets import Dataset
from trl import KTOConfig, KTOTrainer
rows = Dataset.from_list([{"prompt": "ab " * (1 + i % 3), "completion": "cd" * (1 + i % 2),
                           "label": i % 2 == 0} for i in range(4)])
with tempfile.TemporaryDirectory() as tmp:
    args = KTOConfig(tmp, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                     max_steps=1, use_cpu=True, report_to=[], save_strategy="no",
                     disable_tqdm=True)
    KTOTrainer(model=tiny_causal_lm("llama"), ref_model=tiny_causal_lm("llama"), args=args,
               train_dataset=rows, processing_class=char_tokenizer(), callbacks=[Said()]).train()
print("script finished", flush=True)
"""


def _script(folder: Path, name: str, body: str) -> None:
    tests = str(Path(__file__).parents[1])
    (folder / name).write_text(textwrap.dedent(_COMMON.format(tests=tests)) + body)


def test_cli_judges_stock_dpo_under_dpo_and_the_json_names_it(tmp_path: Path) -> None:
    _script(tmp_path, "dpo.py", DPO_SCRIPT)
    result = cli(tmp_path, "--json", "out.json", "--", "python", "dpo.py")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "fullbatch probe: RIGHT" in result.stdout
    assert "(dpo)" in result.stdout
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["exit_status"] == 0
    assert [w["objective"] for w in data["windows"]] == ["dpo"]


def test_cli_refuses_kto_before_the_first_optimizer_step(tmp_path: Path) -> None:
    _script(tmp_path, "kto.py", KTO_SCRIPT)
    result = cli(tmp_path, "--", "python", "kto.py")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "optimizer step" not in result.stdout and "script finished" not in result.stdout
    lines = [line for line in result.stderr.splitlines() if line.startswith("fullbatch probe")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    message = lines[0]
    assert message.startswith("fullbatch probe: error: no --objective given, and cannot infer "
                              "the objective for KTOTrainer: KTOTrainer")  # fmt: skip
    assert "--objective FILE.py:FN" in message
    assert "objective=fn" not in message and "objective=None" not in message  # CLI words
    assert "stopped at the model's first forward, before any step" in message


def test_stock_sft_trainer_with_dft_is_judged_under_its_per_token_loss() -> None:
    """``SFTConfig(loss_type="dft")``: ``-p log p`` (``p`` detached) per target token, summed
    over the window's targets and divided by their count; the stock Trainer counts the window's
    tokens on Llama, so its step is right."""
    from transformers import TrainerCallback
    from trl import SFTTrainer

    from _trl_cases import config, dataset, documents

    first: dict[str, Any] = {}

    class Applied(TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            first.setdefault("grads", [p.grad.clone() for p in kw["model"].parameters()])

    model = tiny_causal_lm("llama")
    start = copy.deepcopy(model)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer: Any = SFTTrainer(
            model=model, args=config(tmp, k=K, batch=BATCH, max_steps=1, loss_type="dft"),
            train_dataset=dataset("prompt", K * BATCH), processing_class=char_tokenizer(),
            callbacks=[Applied()],
        )  # fmt: skip
        recording = Recording(trainer.data_collator)
        trainer.data_collator = recording
        with fb.probe(windows=1) as probe:
            trainer.train()
    docs = documents([r for micro in recording.seen[:K] for r in micro])
    width = max(len(ids) for ids, _ in docs)
    ids = torch.tensor([d + [0] * (width - len(d)) for d, _ in docs])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in docs])[:, 1:]
    mask = torch.tensor([[1] * len(d) + [0] * (width - len(d)) for d, _ in docs])
    logits = start(input_ids=ids, attention_mask=mask).logits[:, :-1].double()
    kept = labels != -100
    lp = F.log_softmax(logits, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    ((-lp * lp.exp().detach())[kept].sum() / kept.sum()).backward()
    error = _error(first["grads"], [p.grad for p in start.parameters()])
    assert error < 1e-6  # the truth (the fused head rounds in float32): right
    check = probe.report.windows[0]
    assert probe.report.ok and check.objective == "sft_dft", str(probe.report)
    assert check.objective_source == ("SFTTrainer (loss_type='dft', summed over the target tokens)")


def test_trainers_are_recognised_by_their_trl_base_and_any_other_trl_class_is_refused() -> None:
    """No trainer is built: a subclass of TRL's ``DPOTrainer`` under another name is DPO
    (``issubclass``, not its name); a class from TRL's experimental package (ORPO) is refused by
    its own name, as is one whose loss type DPO cannot sum per pair."""
    from transformers import Trainer
    from trl import DPOTrainer

    from fullbatch._probe._engines import Engine
    from fullbatch._probe._trainer_objective import trainer_objective

    class MyPreferenceTrainer(DPOTrainer):  # no trainer is constructed: only its class is read
        pass

    class ORPOTrainer(Trainer):
        pass

    ORPOTrainer.__module__ = "trl.experimental.orpo.orpo_trainer"

    def engine(cls: type, **attributes: Any) -> Engine:
        trainer = object.__new__(cls)
        trainer.__dict__.update(attributes)
        return Engine("x", package="trl", trainer=cls.__name__, trainer_object=trainer)

    mine = engine(MyPreferenceTrainer, loss_types=["hinge"], args=None, accelerator=None)
    fn, source = trainer_objective(mine)  # type: ignore[misc]
    assert fn.__name__ == "dpo" and source == (
        "MyPreferenceTrainer (loss_type=['hinge'], summed over pairs)"
    )
    with pytest.raises(Unknown, match=r"for ORPOTrainer: ORPOTrainer trains a loss of its own"):
        trainer_objective(engine(ORPOTrainer))
    mixed = engine(MyPreferenceTrainer, loss_types=["sigmoid", "sft"], args=None)
    with pytest.raises(Unknown, match=r"mixes the 'sft' term .* two counts in one loss"):
        trainer_objective(mixed)

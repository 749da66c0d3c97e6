"""Issue 32's table ("the probe, round 2"), re-measured: each row a script written as users write
them (``benchmarks/probe_round2/``), probed the way a user probes it, beside the truth measured
here against a float64 full batch.

    PYTHONPATH=src python benchmarks/probe_round2.py    # about 3-5 minutes on 2 busy CPU cores

For each row:

- **the probe**: ``python -m fullbatch probe [options] -- python SCRIPT ARGS`` in a subprocess
  (under ``torchrun --standalone --nproc-per-node 2`` for the DDP rows), default options unless
  the row needs one (an objective the script's model cannot be inferred from, ``--windows 2``
  where the row is about it, ``--keep-training``); its verdict, the pattern it names (or what
  else the row is about: a clip reported, one report, the hooks left) and its exit status;
- **the truth**: the same script run here (``exec``, under torchrun for the DDP rows) with a
  global optimizer step pre-hook that reads, at each probed window's ``step()``, the parameters
  and the gradient the optimizer is about to apply; then the gradient of a float64 copy of the
  model at those parameters on the window's rows as one full batch, the loss written here (its
  mean over the window's counted items; clipped like the script where the script clips), and
  the relative error ``‖applied − full batch‖ / ‖full batch‖``, the largest over the windows
  the probe checks (the first two by default). *Rounding* is what a right run of the same kind
  gets: 1e-5 in float32, and for the bfloat16 rows twice the error of the row's right form
  (the same script fixed), measured the same way in this run. The probe *agrees* when it says
  wrong exactly when the error is above rounding (or, where nothing was applied, when it says
  nothing was checked).

The label-smoothing row is measured against the objective the probe is told (plain
cross-entropy): the script accumulates its own smoothed loss exactly, and the probe's answer
is that the loss is not the declared one. The TRL rows run with ``max_grad_norm=0``: at TRL's
default clip of 1.0 these first steps are clipped, and a clip rescales the whole update, hiding
a uniform factor from the update (never from the probe, which compares before the clip).

Each row's test (the wrong form flagged and named, the right form silent), in ``tests/``:
bf16 mean of means: probe/test_probe_judgement.py::test_bfloat16_parameters_mean_of_means_*;
TRL bf16 x0.993: test_probe_judgement.py::test_autocast_float32_gradient_weighted_0993_*
(stock TRL: probe/test_probe_trl.py); float32 x0.97: test_float32_weights_097_are_named_*;
no zero_grad: probe/test_probe_windows.py::test_a_missing_zero_grad_is_caught_at_the_default_*
and probe/test_probe_cli.py::test_missing_zero_grad_exits_1_*; two optimizers:
probe/test_probe_optimizers.py (doubled; right, one window each step); validation forward:
probe/test_probe_micro_batches.py::test_a_validation_forward_with_gradients_is_no_micro_batch;
imported clip: test_probe_judgement.py::test_clip_grad_norm_imported_before_the_probe_is_seen;
label smoothing: test_probe_judgement.py::test_label_smoothing_is_a_different_loss_*; off-by-one:
test_probe_judgement.py::test_off_by_one_first_window_is_a_partial_window_*; per-rank count:
probe/test_probe_ddp.py::test_each_rank_dividing_by_its_own_count_is_named_on_every_rank; global
y and the book's loop: probe/test_probe_micro_batch.py (top level, book loop); Composer:
test_probe_micro_batch.py::test_composer_huggingface_model_objective_inferred_through_model;
never steps, --keep-training: test_probe_cli.py (exits 3; the script's later failure); one
report: probe/test_probe_torchrun.py; hooks: probe/test_probe_changes_nothing.py::
test_hooks_are_gone_right_after_the_last_probed_window; scaled loss:
mistakes/test_scaled_loss.py; weighted count: probe/test_probe_weighted_loss.py.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

HERE = Path(__file__).resolve().parent / "probe_round2"
ROOT = Path(__file__).resolve().parent.parent
PATTERNS = (
    "mean of per-micro-batch means", "not normalized", "per-rank count", "dropped",
    "counted twice", "leftover gradient", "ranks differ", "partial window", "loss differs",
    "nothing to check", "unsupported", "other",
)  # fmt: skip
GPT2 = ("GPT2LMHeadModel", "GPT2Model")
WEIGHTS = torch.tensor([0.1, 0.5, 4.0, 0.2, 1.0, 1.0, 2.0], dtype=torch.float64)


class Stop(Exception):
    """Raised by the step hook once the probed windows have been read."""


# -- the float64 full batch of each kind of script ---------------------------------------------


def rows_of(micros: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(micros[0], dict):
        return torch.cat([m["x"] for m in micros]), torch.cat([m["labels"] for m in micros])
    return torch.cat([m[0] for m in micros]), torch.cat([m[1] for m in micros])


def classes(name: str = "loader", k: int = 4, **ce: Any) -> Callable[..., torch.Tensor]:
    """Window ``w`` is micro-batches ``k·w .. k·w + k − 1`` of the script's ``name``."""

    def loss(g: dict[str, Any], w: int, model: torch.nn.Module, calls: list[Any]) -> torch.Tensor:
        x, y = rows_of(list(g[name])[k * w : k * w + k])
        return F.cross_entropy(model(x.double()), y, ignore_index=-100, **ce)

    return loss


def off_by_one(g: dict[str, Any], w: int, model: torch.nn.Module, calls: list[Any]) -> torch.Tensor:
    x, y = rows_of(g["train_loader"][:1] if w == 0 else g["train_loader"][1:5])
    return F.cross_entropy(model(x.double()), y)


def global_y(g: dict[str, Any], w: int, model: torch.nn.Module, calls: list[Any]) -> torch.Tensor:
    rows = slice(24 * w, 24 * w + 24)  # 4 micro-batches of 6 rows
    return F.cross_entropy(model(g["X"][rows].double()), g["y"][rows])


def book(g: dict[str, Any], w: int, model: torch.nn.Module, calls: list[Any]) -> torch.Tensor:
    x, y = rows_of(list(g["train_loader"])[4 * w : 4 * w + 4])
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def ranks(g: dict[str, Any], w: int, model: torch.nn.Module, calls: list[Any]) -> torch.Tensor:
    micros = [m for r in sorted(g["data"]) for m in g["data"][r][4 * w : 4 * w + 4]]
    x, y = rows_of(micros)
    return F.cross_entropy(model(x.double()), y)


def causal_lm(g: dict[str, Any], w: int, model: torch.nn.Module, calls: list[Any]) -> torch.Tensor:
    """The window's 4 recorded forwards, every target after the shift counted once."""
    total, count = torch.zeros((), dtype=torch.float64), 0
    for kwargs in calls[4 * w : 4 * w + 4]:
        ids, mask = kwargs["input_ids"], kwargs.get("attention_mask")
        labels = kwargs.get("labels")
        if labels is None:
            labels = ids.masked_fill(mask == 0, -100) if mask is not None else ids
        logits = model(input_ids=ids, attention_mask=mask).logits
        targets = labels[:, 1:]
        total = total + F.cross_entropy(
            logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum"
        )
        count += int((targets != -100).sum())
    return total / count


def weighted(g: dict[str, Any], w: int, model: torch.nn.Module, calls: list[Any]) -> torch.Tensor:
    x, y = rows_of(g["loader"][4 * w : 4 * w + 4])
    return F.cross_entropy(model(x.double()), y, weight=WEIGHTS)


# -- the rows -----------------------------------------------------------------------------------


@dataclass
class Row:
    name: str
    script: str
    truth: Callable[..., torch.Tensor] | None
    args: list[str] = field(default_factory=list)  # the script's own arguments
    probe: list[str] = field(default_factory=list)  # the probe's options
    torchrun: bool = False
    steps: int = 1  # optimizer steps per window
    windows: int = 2  # windows the probe checks (its default)
    clip: float | None = None
    model: str = "model"
    right_form: tuple[str, list[str]] | None = None  # the same kind, fixed: its error is rounding
    note: Callable[[str], str] | None = None  # what else the probe's output shows


def clip_seen(out: str) -> str:
    return "clip reported" if "clip_grad_norm_(max_norm=" in out else "no clip reported"


def hooks_left(out: str) -> str:
    found = re.search(r"hooks after window 2: (\d+)", out)
    return f"{found.group(1) if found else '?'} hooks left after window 1"


def reports(out: str) -> str:
    return f"{out.count('fullbatch probe: ')} report(s) for 2 ranks"


def lines_tail(out: str) -> str:
    last = [line for line in out.splitlines() if line.strip()]
    return last[-1][:70] if last else ""


SAMPLE = ["--objective", "sample"]
ROWS = [
    Row("bf16 params, mean of per-micro-batch means", "bf16_mean_of_means.py", classes(),
        probe=SAMPLE, right_form=("bf16_right.py", [])),
    Row("TRL SFTTrainer on GPT-2, TRL's bf16 (autocast)", "trl_sft.py", causal_lm,
        right_form=("trl_sft.py", ["--exact"])),
    Row("TRL SFTTrainer on GPT-2, float32", "trl_sft.py", causal_lm, args=["--fp32"]),
    Row("float32, every micro-batch x0.97 (padding counted)", "float32_097.py", classes(),
        probe=SAMPLE),
    Row("no zero_grad() after a step, default windows", "no_zero_grad.py", classes(),
        probe=SAMPLE),
    Row("two optimizers, one's gradients doubled", "two_optimizers.py", classes(),
        args=["--doubled"], probe=SAMPLE, steps=2),
    Row("two optimizers, correct, --windows 2", "two_optimizers.py", classes(),
        probe=[*SAMPLE, "--windows", "2"], steps=2),
    Row("validation forward with grad enabled, no backward", "validation_forward.py", classes(),
        probe=SAMPLE),
    Row("`from torch.nn.utils import clip_grad_norm_`, clip active", "clip_imported.py",
        classes(), probe=SAMPLE, clip=0.1, note=clip_seen),
    Row("label smoothing 0.1, declared sample (vs declared)", "label_smoothing.py", classes(),
        probe=SAMPLE),
    Row("`batch_idx % K == 0` off-by-one, default windows", "off_by_one.py", off_by_one,
        probe=SAMPLE),
    Row("DDP, each rank divides by its own count", "ddp.py", ranks, probe=SAMPLE,
        torchrun=True, model="net"),
    Row("DDP, the window's count (torchrun: one report)", "ddp.py", ranks,
        args=["--global-count"], probe=SAMPLE, torchrun=True, model="net", note=reports),
    Row("top-level loop beside a global y", "top_level_global_y.py", global_y, probe=SAMPLE),
    Row("LLMs-from-scratch loop (`for batch_idx, (input_batch, target_batch)`)",
        "llms_from_scratch.py", book, probe=["--objective", "token"]),
    Row("script that never steps", "never_steps.py", None, probe=SAMPLE),
    Row("--keep-training, the script exits 5 in window 3", "fails_later.py", classes(),
        probe=[*SAMPLE, "--keep-training"], note=lines_tail),
    Row("hooks after the probed windows (--windows 1 --keep-training)", "hooks_gone.py",
        classes(), probe=[*SAMPLE, "--windows", "1", "--keep-training"], windows=1,
        note=hooks_left),
    Row("fullbatch loop: window.backward(scaler.scale(loss_sum), n)",
        "fullbatch_scaled_loss.py", classes(), probe=SAMPLE, note=lines_tail),
    Row("fullbatch loop: class-weighted CE, count = rows", "fullbatch_weighted_count.py",
        weighted, probe=["--objective", "objectives.py:weighted"]),
    Row("fullbatch loop: class-weighted CE, count = weights' sum",
        "fullbatch_weighted_count.py", weighted, args=["--weights-sum"],
        probe=["--objective", "objectives.py:weighted"]),
]  # fmt: skip


# -- the truth ----------------------------------------------------------------------------------


def run_script(row: Row, script: str, args: list[str]) -> tuple[dict[str, Any], list[Any], Any]:
    """Run ``script`` here, recording per window each stepped parameter's value and gradient."""
    records: list[dict[str, Any]] = []
    calls: list[Any] = []

    def pre(opt: torch.optim.Optimizer, *_: Any) -> None:
        if not records or records[-1]["steps"] == row.steps:
            records.append({"steps": 0, "params": {}})
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    value = p.detach().double().clone()
                    records[-1]["params"][id(p)] = (value, p.grad.detach().double().clone())
        records[-1]["steps"] += 1

    def post(*_: Any) -> None:
        if len(records) == row.windows and records[-1]["steps"] == row.steps:
            raise Stop

    def forward(module: torch.nn.Module, args: Any, kwargs: Any, out: Any) -> None:
        # a GPT-2's forwards, with or without its head (a trainer may run its own head); the
        # inner call's hook runs first, the outer one (same input_ids) then completes it
        if not torch.is_grad_enabled() or type(module).__name__ not in GPT2:
            return
        seen = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
        if "input_ids" not in seen:
            return
        if calls and calls[-1]["input_ids"] is seen["input_ids"]:
            calls[-1] = {**calls[-1], **seen}
        else:
            calls.append(seen)

    path = HERE / script
    g: dict[str, Any] = {"__name__": "__main__", "__file__": str(path)}
    handles = [
        register_optimizer_step_pre_hook(pre),
        register_optimizer_step_post_hook(post),
        torch.nn.modules.module.register_module_forward_hook(forward, with_kwargs=True),
    ]
    argv, sys.argv = sys.argv, [str(path), *args]
    sys.path.insert(0, str(HERE))
    failure = None
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            exec(compile(path.read_text(), str(path), "exec"), g)
    except Stop:
        pass
    except BaseException as e:  # the script's own failure (a refusal, sys.exit)
        failure = e
    finally:
        sys.argv = argv
        sys.path.remove(str(HERE))
        for handle in handles:
            handle.remove()
    return g, calls, (records, failure)


def measure(row: Row, script: str, args: list[str]) -> dict[str, Any]:
    """The largest relative error of the applied gradient over the probed windows."""
    g, calls, (records, failure) = run_script(row, script, args)
    windows = [r for r in records if r["steps"] == row.steps][: row.windows]
    if row.truth is None or not windows:
        why = f"{type(failure).__name__}: {failure}" if failure is not None else "no step"
        return {"error": None, "why": why.splitlines()[0][:60]}
    model = g[row.model]
    model = getattr(model, "module", model)
    errors = []
    for w, record in enumerate(windows):
        ref = copy.deepcopy(model).double()
        if hasattr(ref, "gradient_checkpointing_disable"):  # TRL turns it on: plain autograd here
            ref.gradient_checkpointing_disable()
        ref.__dict__.pop("forward", None)  # Accelerate's autocast wrapper, bound to the original
        stepped = []
        with torch.no_grad():
            for (_, p), (_, orig) in zip(
                ref.named_parameters(), model.named_parameters(), strict=True
            ):
                if id(orig) in record["params"]:
                    p.copy_(record["params"][id(orig)][0])
                    stepped.append((p, record["params"][id(orig)][1]))
        grads = torch.autograd.grad(row.truth(g, w, ref, calls), [p for p, _ in stepped])
        if row.clip is not None:  # the full batch clipped as the script clips
            norm = torch.stack([gr.norm() for gr in grads]).norm()
            grads = tuple(gr * min(1.0, row.clip / (float(norm) + 1e-6)) for gr in grads)
        diff = sum(float((a - r).pow(2).sum()) for (_, a), r in zip(stepped, grads, strict=True))
        errors.append((diff / sum(float(r.pow(2).sum()) for r in grads)) ** 0.5)
    return {"error": max(errors), "windows": len(errors)}


def measure_torchrun(row: Row) -> dict[str, Any]:
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", __file__, "--truth", str(ROWS.index(row))]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    found = re.search(r"^TRUTH (.*)$", out.stdout, re.M)
    if found is None:
        raise RuntimeError(f"the truth run of {row.name} failed:\n{out.stdout}\n{out.stderr}")
    return dict(json.loads(found.group(1)))


# -- the probe ----------------------------------------------------------------------------------


def probe(row: Row) -> tuple[str, str, int, str]:
    """The probe's verdict, pattern and exit status, as a user runs it; and its whole output."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # fmt: skip
    launch = [sys.executable]
    if row.torchrun:
        launch += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd = [*launch, "-m", "fullbatch", "probe", *row.probe, "--", "python", row.script, *row.args]
    out = subprocess.run(cmd, cwd=HERE, capture_output=True, text=True, env=env, timeout=300)
    text = out.stdout + out.stderr
    status = out.returncode
    if row.torchrun:  # torchrun exits 1 when any rank fails; the ranks' own status is the probe's
        status = 0 if out.returncode == 0 else (1 if "WRONG" in out.stdout else out.returncode)
    head = next((line for line in out.stdout.splitlines() if "fullbatch probe: " in line), "")
    verdict = head.split("fullbatch probe: ")[1].split(" (")[0] if head else "(no report)"
    pattern = "right" if verdict == "RIGHT" else ""
    for line in out.stdout.splitlines():
        text_line = line.strip()
        one = re.match(
            r"(optimizer \d+) \((\w+): .*\): WRONG, (.+?) \(.*factor ([0-9.]+)", text_line
        )
        if pattern or not line.startswith("  "):
            continue
        if one is not None:  # a mistake confined to one optimizer's parameters
            pattern = f"{one.group(1)} ({one.group(2)}): {one.group(3)} (factor {one.group(4)})"
        elif text_line.startswith("the loss differs"):
            pattern = "loss differs"
        else:
            pattern = next((p for p in PATTERNS if text_line.startswith(p)), "")
    factor = re.search(r"factor on the full-batch gradient: ([0-9.]+)", out.stdout)
    if verdict == "WRONG" and factor is not None and pattern in PATTERNS[1:]:
        pattern += f" (factor {factor.group(1)})"
    if verdict not in ("RIGHT", "WRONG"):
        pattern = head.split(" (")[0].removeprefix("fullbatch probe: ") if head else ""
    return verdict, pattern, status, text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="", help="the rows whose name contains this text")
    parser.add_argument("--truth", type=int, help=argparse.SUPPRESS)  # one row, under torchrun
    opts = parser.parse_args()
    torch.set_num_threads(1)
    if opts.truth is not None:
        row = ROWS[opts.truth]
        result = measure(row, row.script, row.args)
        if int(os.environ.get("RANK", "0")) == 0:
            print("TRUTH " + json.dumps(result), flush=True)
        return
    start = time.perf_counter()
    print("| row | probe: verdict, pattern | exit | error vs float64 full batch | rounding "
          "| agrees |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for row in [r for r in ROWS if opts.only in r.name]:
        verdict, pattern, status, text = probe(row)
        truth = measure_torchrun(row) if row.torchrun else measure(row, row.script, row.args)
        rounding = 1e-5
        if row.right_form is not None:
            right = measure(row, *row.right_form)["error"]
            rounding = max(rounding, 2 * right)
        said = f"{verdict}, {pattern}" if pattern and pattern != verdict else verdict
        if row.note is not None:
            said += f"; {row.note(text)}"
        if truth["error"] is None:
            error, agrees = f"nothing applied ({truth['why']})", status not in (0, 1)
        else:
            error = f"{truth['error']:.2e}"
            agrees = (verdict == "WRONG") == (truth["error"] > rounding)
        print(
            f"| {row.name} | {said} | {status} | {error} | {rounding:.0e} "
            f"| {'yes' if agrees else '**NO**'} |",
            flush=True,
        )
    print("| Composer `HuggingFaceModel` | not installed here (composer is not importable) "
          "| | | | |")  # fmt: skip
    print(f"\n{len(ROWS)} rows in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()

"""Accelerate's own gradient accumulation vs fullbatch on Accelerate-prepared objects.

    python benchmarks/integration_accelerate.py

The common work of the three framework integrations: a tiny Llama (float32, byte-level,
``tiny_llama(seed=0, max_length=128)``), 64 standard-library docstrings
(``read_corpus(64, seed=0)``) in micro-batches of 4 right-padded rows, one window = 4
micro-batches = 16 rows, SGD lr=0.1, 4 steps. Three runs on the same data, each through
``accelerator.prepare(model, optimizer, loader)`` on CPU:

- full batch: ``Accelerator()``, the window's 16 rows right-padded together, ``outputs.loss``,
  ``accelerator.backward``, ``optimizer.step()`` (Accelerate with no accumulation);
- Accelerate: ``Accelerator(gradient_accumulation_steps=4)``, the documented loop
  (``with accelerator.accumulate(model)``, ``accelerator.backward(outputs.loss)``);
- fullbatch: ``Accelerator()``, ``fb.Accumulator(model, optimizer, micro_batches=4)``,
  ``window.backward(*fb.causal_lm_loss(...))``.

Per run: the relative L2 error ``‖g - g_ref‖ / ‖g_ref‖`` of the gradient the optimizer receives
(an optimizer step pre-hook) vs the full-batch gradient of the same 16 rows *at the same
parameters*, and the max |parameter difference| from the full-batch run after 4 steps. The
second row drops the last 8 rows: the 4th window is partial (2 micro-batches); its gradient
error is the one reported (Accelerate's ``sync_with_dataloader`` steps it, still dividing by 4).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader

import fullbatch as fb
from fullbatch._demo._arms import relative_error
from fullbatch._demo._corpus import make_batches, read_corpus
from fullbatch._demo._model import tiny_llama

ROWS, MICRO_ROWS, MICRO_BATCHES, LR = 64, 4, 4, 0.1
Batch = dict[str, torch.Tensor]


def fresh_accelerator(**kwargs: Any) -> Any:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)  # Accelerate's state is a process-wide singleton
    GradientState._reset_state()
    return Accelerator(cpu=True, **kwargs)


class Recorder:
    """At every optimizer step: the parameters before it and the gradients it receives."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.steps: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
        optimizer.register_step_pre_hook(self._hook)

    def _hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        ps = [p for g in optimizer.param_groups for p in g["params"]]
        self.steps.append(([p.detach().clone() for p in ps], [p.grad.clone() for p in ps]))


def full_batch_grad(start: torch.nn.Module, params: list[torch.Tensor], whole: Batch) -> list:
    """The full-batch gradient of ``whole`` (``outputs.loss``: the mean over its tokens)."""
    model = copy.deepcopy(start)
    with torch.no_grad():
        for p, v in zip(model.parameters(), params, strict=True):
            p.copy_(v)
    model(**whole).loss.backward()
    return [p.grad for p in model.parameters()]


def run(
    how: str, start: torch.nn.Module, micros: list[Batch], wholes: list[Batch]
) -> tuple[Recorder, list[torch.Tensor]]:
    model = copy.deepcopy(start).train()
    inner = torch.optim.SGD(model.parameters(), lr=LR)
    rec = Recorder(inner)
    if how == "full batch":
        accelerator = fresh_accelerator()
        model, opt, dl = accelerator.prepare(model, inner, DataLoader(wholes, batch_size=None))
        for whole in dl:
            accelerator.backward(model(**whole).loss)
            opt.step()
            opt.zero_grad()
    elif how == "Accelerate accumulate()":
        accelerator = fresh_accelerator(gradient_accumulation_steps=MICRO_BATCHES)
        model, opt, dl = accelerator.prepare(model, inner, DataLoader(micros, batch_size=None))
        for micro in dl:
            with accelerator.accumulate(model):
                accelerator.backward(model(**micro).loss)
                opt.step()
                opt.zero_grad()
    else:
        accelerator = fresh_accelerator()
        model, opt, dl = accelerator.prepare(model, inner, DataLoader(micros, batch_size=None))
        with fb.Accumulator(model, opt, micro_batches=MICRO_BATCHES) as acc:
            for window in acc.windows(dl):
                for micro in window:
                    logits = model(
                        input_ids=micro["input_ids"], attention_mask=micro["attention_mask"]
                    ).logits
                    window.backward(*fb.causal_lm_loss(logits, micro["labels"]))
                window.step()
    return rec, [p.detach().clone() for p in model.parameters()]


def measure(rows: int) -> dict[str, tuple[float, float]]:
    loaded = tiny_llama(seed=0, max_length=128, dtype=torch.float32)
    corpus = read_corpus(ROWS, seed=0, encode=loaded.encode)
    data = corpus.rows[:rows]
    micros = make_batches(data, batch_size=MICRO_ROWS, pad_id=loaded.pad_id)
    window_rows = MICRO_ROWS * MICRO_BATCHES
    wholes = [
        make_batches(
            data[i : i + window_rows],
            batch_size=len(data[i : i + window_rows]),
            pad_id=loaded.pad_id,
        )[0]
        for i in range(0, rows, window_rows)
    ]
    start = loaded.model
    which = 0 if rows == ROWS else len(wholes) - 1  # first window, or the partial last one
    _, full_params = run("full batch", start, micros, wholes)
    out = {}
    for how in ("Accelerate accumulate()", "fullbatch"):
        rec, params = run(how, start, micros, wholes)
        assert len(rec.steps) == len(wholes), (how, len(rec.steps))
        before, grads = rec.steps[which]
        err = relative_error(grads, full_batch_grad(start, before, wholes[which]))
        diff = max(float((p - q).abs().max()) for p, q in zip(params, full_params, strict=True))
        out[how] = (err, diff)
    return out


def main(report: Callable[[str], None] = print) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    import accelerate

    first = measure(ROWS)
    partial = measure(ROWS - 8)
    report(
        f"tiny Llama float32, accelerate {accelerate.__version__}, torch {torch.__version__}, "
        "SGD lr=0.1, 4 steps; error vs Accelerate with no accumulation (the 16 rows in one batch)"
    )
    report("")
    report("| window | method | gradient rel. L2 error | max abs param diff after 4 steps |")
    report("|---|---|---|---|")
    for label, result in (
        ("1st (16 rows, 4 x 4)", first),
        ("4th, partial (8 rows, 2 x 4)", partial),
    ):
        for how, (err, diff) in result.items():
            report(f"| {label} | {how} | {err:.1e} | {diff:.1e} |")


if __name__ == "__main__":
    main()

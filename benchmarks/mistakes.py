"""Issues 18 and 26, re-measured: each migration mistake's first-step gradient error, and what
fullbatch says now when the mistake is made through it.

Tiny Llama from a config (random init, float64), 8 right-padded rows of 5 to 24 tokens,
micro-batches of 2 rows (K = 4). The error is ``‖g' - g‖ / ‖g‖`` between the gradient the
mistaken recipe accumulates (``Σ S'_k / Σ n'_k`` over the micro-batches, as a correct
accumulator would normalize it) and the plain full-batch gradient ``∇ Σ S / N``.

    python benchmarks/mistakes.py                    # both tables (~1 min; 2 gloo ranks)
    python benchmarks/mistakes.py --table labels     # issue 18's table (~20 s)
    python benchmarks/mistakes.py --table migration  # issue 26's table (_migration_rows.py)
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import transformers

import fullbatch as fb

PAD, IGNORE, MICRO = 0, -100, 2
LENGTHS = (24, 5, 17, 9, 21, 6, 13, 11)


def model_and_batch() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        pad_token_id=PAD,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).double()
    g = torch.Generator().manual_seed(0)
    width = max(LENGTHS)
    ids = torch.full((len(LENGTHS), width), PAD)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(LENGTHS):
        ids[row, :n] = torch.randint(1, 64, (n,), generator=g)
        mask[row, :n] = 1
    return model, {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": ids.masked_fill(mask == 0, IGNORE),
    }


def logits(model: torch.nn.Module, micro: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"]).logits


def pre_shifted(micro: dict[str, torch.Tensor]) -> torch.Tensor:
    ids, mask = micro["input_ids"], micro["attention_mask"]
    labels = torch.full_like(ids, IGNORE)
    labels[:, :-1] = ids[:, 1:].masked_fill(mask[:, 1:] == 0, IGNORE)
    return labels


def correct(m: Any, micro: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
    return fb.causal_lm_loss(logits(m, micro), micro["labels"])


def shifted_twice(m: Any, micro: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
    return fb.causal_lm_loss(logits(m, micro), pre_shifted(micro))


def pad_labelled(m: Any, micro: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
    return fb.causal_lm_loss(logits(m, micro), micro["input_ids"])


def mean_with_count(m: Any, micro: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
    out, labels = logits(m, micro)[:, :-1], micro["labels"][:, 1:]
    mean = F.cross_entropy(out.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)
    return mean, fb.count_tokens(micro["labels"])


def unshifted_count(m: Any, micro: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
    return fb.causal_lm_loss(logits(m, micro), micro["labels"])[0], micro["attention_mask"].sum()


def micro_batches(batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    rows = len(LENGTHS)
    return [{k: v[i : i + MICRO] for k, v in batch.items()} for i in range(0, rows, MICRO)]


def grad(model: torch.nn.Module, loss: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss.backward()
    out = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return out


def accumulated(model: Any, batch: Any, loss_fn: Callable[..., Any], share: bool = False) -> Any:
    """``∇ Σ S'_k / Σ n'_k`` (or ``∇ Σ S'_k`` for an undivided share)."""
    terms = [loss_fn(model, micro) for micro in micro_batches(batch)]
    total = sum(s for s, _ in terms)
    return grad(model, total if share else total / sum(float(n) for _, n in terms))


def error(got: torch.Tensor, want: torch.Tensor) -> str:
    return f"{float((got - want).norm() / want.norm()):.1%}"


def says(run: Callable[[], Any]) -> str:
    """The first exception or warning fullbatch raises for ``run()``, shortened."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            run()
        except Exception as exc:  # the message is the measurement
            return f"{type(exc).__name__}: {str(exc)[:90]}..."
    # fullbatch's warnings point at the line that made the call: a line of this benchmark
    here = Path(__file__).resolve().parent
    ours = [w for w in caught if Path(w.filename).resolve().parent == here]
    if not ours:
        return "nothing"
    return f"{ours[0].category.__name__}: {str(ours[0].message)[:90]}..."


def through_fullbatch(
    loss_fn: Callable[..., Any], labels: Callable[..., Any] | None = None
) -> Callable[[], Any]:
    """One window through fb.Accumulator; ``labels(batch)`` puts the mistake in the batch."""

    def run() -> None:
        model, batch = model_and_batch()
        if labels is not None:
            batch = {**batch, "labels": labels(batch)}
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with fb.Accumulator(model, opt, micro_batch_size=MICRO) as acc:
            for window in acc.windows([batch]):
                for micro in window:
                    window.backward(*loss_fn(model, micro))
                window.step()

    return run


def labels_table() -> None:
    model, batch = model_and_batch()
    want = grad(model, correct(model, batch)[0] / correct(model, batch)[1])
    rows: list[tuple[str, str, str]] = []

    # scheduler.step() once per micro-batch without scheduler=
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    lrs = []  # the LR each optimizer step uses: the scheduler ran K times before it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own "scheduler before optimizer" warning
        for _ in range(3):
            for _ in micro_batches(batch):
                sched.step()
            lrs.append(opt.param_groups[0]["lr"])
    wanted = [0.05 * 0.5**i for i in range(3)]

    def per_micro_scheduler() -> None:
        m, b = model_and_batch()
        o = torch.optim.SGD(m.parameters(), lr=0.05)
        s = torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)
        with fb.Accumulator(m, o, micro_batch_size=MICRO) as acc:
            for window in acc.windows([b]):
                for micro in window:
                    window.backward(*correct(m, micro))
                    s.step()
                window.step()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own "scheduler before optimizer" warning
        rows.append(
            (
                "`scheduler.step()` per micro-batch, no `scheduler=`",
                f"LR used at steps 1-3: {' / '.join(f'{x:.2g}' for x in lrs)} instead of "
                f"{' / '.join(f'{x:.3g}' for x in wanted)}",
                says(per_micro_scheduler),
            )
        )
    in_batch = {shifted_twice: pre_shifted, pad_labelled: lambda b: b["input_ids"]}
    for name, fn in [
        ("labels already shifted, passed to `fb.causal_lm_loss`", shifted_twice),
        ("padding labelled with the pad id, not -100", pad_labelled),
        ('`F.cross_entropy(reduction="mean")` passed with count n', mean_with_count),
        ("summed loss with `attention_mask.sum()` as count", unshifted_count),
    ]:
        labels = in_batch.get(fn)
        now = says(through_fullbatch(correct if labels else fn, labels))
        if fn is mean_with_count:  # a loss value has no unit: verify's additivity check
            report = fb.verify(model, batch, fn, micro_batch_size=MICRO)
            verdict = "PASSED" if report.passed else "FAILED"
            now += f"; `fb.verify`: {verdict}: {(report.diagnosis or [''])[-1][:90]}..."
        rows.append((name, error(accumulated(model, batch, fn), want), now))

    counts = {"tokens": lambda m: fb.count_tokens(m["labels"])}

    def share_run() -> None:
        m, b = model_and_batch()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        with fb.Accumulator(m, opt, micro_batch_size=MICRO, counts=counts) as acc:
            for window in acc.windows([b]):
                for micro in window:
                    window.backward(correct(m, micro)[0])  # not divided by window.totals
                window.step()

    rows.append(
        (
            "`counts=` share not divided by `window.totals`",
            error(accumulated(model, batch, correct, share=True), want),
            says(share_run),
        )
    )

    def subset_run() -> None:
        m, _ = model_and_batch()
        fb.Accumulator(m, torch.optim.SGD(m.lm_head.parameters(), lr=0.1), micro_batches=2).close()

    head = model.lm_head.weight.numel()
    untrained = float(want[:-head].norm() / want.norm())  # lm_head is the last parameter
    rows.append(
        (
            "optimizer on a subset of the parameters",
            f"{untrained:.1%} of the gradient never applied",
            says(subset_run),
        )
    )

    def row_dicts_run() -> None:
        m, b = model_and_batch()
        rows_ = [{k: v[i] for k, v in b.items()} for i in range(2)]
        with fb.Accumulator(m, torch.optim.SGD(m.parameters(), lr=0.1), micro_batches=2) as acc:
            for window in acc.windows([rows_, rows_]):
                next(iter(window))
                window.discard()

    rows.append(
        (
            "list of per-row dicts with `micro_batches=K`",
            "user code breaks later",
            says(row_dicts_run),
        )
    )

    print("| mistake | first-step gradient error | what fullbatch says now |")
    print("|---|---|---|")
    for name, err, now in rows:
        print(f"| {name} | {err} | {now.replace('|', '/')} |")


def migration_table() -> None:
    from _migration_rows import rows

    print("| mistake | what fullbatch does now | the mistake's first-step error |")
    print("|---|---|---|")
    for name, now, err in rows():
        print(f"| {name} | {now} | {err} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--table", choices=["labels", "migration", "all"], default="all")
    table = parser.parse_args().table
    if table in ("labels", "all"):
        labels_table()
    if table == "all":
        print()
    if table in ("migration", "all"):
        migration_table()


if __name__ == "__main__":
    main()

"""Issue 26's silent migration mistakes, re-measured for ``benchmarks/mistakes.py``.

Each row makes the mistake through fullbatch and says what happens now (``raises`` /
``warns`` / ``silent``), and gives the mistake's first-step error: for a mistake fullbatch
now refuses, the same recipe computed without fullbatch's checks (plain PyTorch, or
fullbatch's documented opt-out that reproduces the old behaviour); for one that stays silent
by design, measured through fullbatch. Same tiny Llama, batch and micro-batches as the issue
18 table (float64, 8 right-padded rows of 5 to 24 tokens, micro-batches of 2 rows).
"""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

import fullbatch as fb
from mistakes import IGNORE, MICRO, correct, grad, logits, micro_batches, model_and_batch

Row = tuple[str, str, str]
HERE = Path(__file__).resolve()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()))


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def status(run: Callable[[], Any]) -> str:
    """What fullbatch does when ``run()`` makes the mistake: raises, warns or silent."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            run()
        except Exception as exc:  # the message is the measurement
            return f"raises {type(exc).__name__}: {_head(str(exc))}"
    # fullbatch's warnings point at the line that made the call: here, in this benchmark
    ours = [w for w in caught if Path(w.filename).resolve().parent == HERE.parent]
    if ours:
        return f"warns: {_head(str(ours[0].message))}"
    return "silent"


def _head(message: str, limit: int = 100) -> str:
    """The message's first sentence, cut at ``limit`` characters."""
    first = message.split(". ")[0]
    return (first if len(first) <= limit else first[:limit] + "...").replace("|", "/")


def one_window(
    body: Callable[..., None], batch: Any = None, loader: Any = None, **options: Any
) -> Any:
    """The first window through fullbatch, SGD(lr=1): ``(update, stats, model)``."""
    model, default = model_and_batch()
    batch = default if batch is None else batch
    before = _flat(model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    options = options or {"micro_batch_size": MICRO}
    with fb.Accumulator(model, opt, **options) as acc:
        for window in acc.windows([batch] if loader is None else loader):
            for micro in window:
                body(model, window, micro)
            stats = window.step()
            break
    return before - _flat(model), stats, model


def _plain(model: Any, window: Any, micro: Any) -> None:
    window.backward(*correct(model, micro))


def emulated(batch: Any, term: Callable[[Any, Any], Any]) -> torch.Tensor:
    """``∇ Σ S'_k / Σ n'_k`` of a mistaken term, in plain PyTorch (no fullbatch check)."""
    model, _ = model_and_batch()
    terms = [term(model, micro) for micro in micro_batches(batch)]
    return grad(model, sum(s for s, _ in terms) / sum(float(n) for _, n in terms))


def rows() -> list[Row]:
    model, batch = model_and_batch()
    want = grad(model, correct(model, batch)[0] / correct(model, batch)[1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the measuring runs; status() records its own
        out: list[Row] = [_ddp_row(want)]
        out += _pack_rows(want)
        out += _window_size_rows(batch, want)
        out += _loss_rows(batch, want)
        out += _splitting_rows(batch)
        out += _optimizer_rows(want)
        out += _unit_rows(batch, want)
        out += [_scaler_row(batch, want), _weighted_row(batch)]
    return out


# -- 1. DDP: forward through ddp.module ------------------------------------------------------


def _ddp_rank(rank: int, world: int, store: str, queue: Any) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    model, batch = model_and_batch()
    ddp = DDP(model)
    mine = {k: v[rank * 4 : (rank + 1) * 4] for k, v in batch.items()}
    opt = torch.optim.SGD(ddp.parameters(), lr=1.0)

    def run() -> None:
        with fb.Accumulator(ddp, opt, micro_batch_size=MICRO) as acc:
            for window in acc.windows([mine]):
                for micro in window:
                    window.backward(*correct(ddp.module, micro))
                window.step()

    queue.put((rank, status(run)))
    dist.destroy_process_group()


def _ddp_row(want: torch.Tensor) -> Row:
    model, batch = model_and_batch()
    n = float(correct(model, batch)[1])
    halves = [
        grad(model, correct(model, {k: v[r * 4 : r * 4 + 4] for k, v in batch.items()})[0])
        for r in range(2)
    ]
    ranks = [2 * g / n for g in halves]  # unsynced: each rank's half, times W / N
    error = (
        f"{_rel(ranks[0], want):.0%} (rank 0); ranks' updates {_rel(ranks[0], ranks[1]):.0%} apart"
    )
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_ddp_rank, args=(r, 2, store, queue)) for r in range(2)]
        for p in procs:
            p.start()
        said = dict(queue.get(timeout=300) for _ in procs)
        for p in procs:
            p.join(timeout=60)
    now = said[0] if said[0] == said[1] else f"rank 0 {said[0]}; rank 1 {said[1]}"
    return (
        "DDP: Accumulator on the wrapper, forward through `ddp.module` (2 gloo ranks)",
        now + " (every rank)",
        error,
    )


# -- 2. pack=True in the plain loop -------------------------------------------------------------


def _pack_rows(want: torch.Tensor) -> list[Row]:
    calls = {
        "the cache left on": lambda m, mi: m(
            input_ids=mi["input_ids"], position_ids=mi["position_ids"]
        ),
        "a 2-D attention mask": lambda m, mi: m(
            input_ids=mi["input_ids"],
            attention_mask=torch.ones_like(mi["input_ids"]),
            position_ids=mi["position_ids"],
            use_cache=False,
        ),
        "no `position_ids`": lambda m, mi: m(input_ids=mi["input_ids"], use_cache=False),
    }
    out = []
    options = {"micro_batch_tokens": 48, "pack": True}
    for name, call in calls.items():

        def body(model: Any, window: Any, micro: Any, call: Any = call) -> None:
            window.backward(*fb.causal_lm_loss(call(model, micro).logits, micro["labels"]))

        old, _, _ = one_window(body, verify_pack=False, **options)  # the old plain loop
        now = status(lambda body=body: one_window(body, **options))
        out.append(
            (
                f"`pack=True`, plain loop, {name}",
                now,
                f"{_rel(old, want):.1%} (verify_pack=False: the old loop)",
            )
        )

    def documented(model: Any, window: Any, micro: Any) -> None:
        out_ = model(**{k: v for k, v in micro.items() if k != "labels"})
        window.backward(*fb.causal_lm_loss(out_.logits, micro["labels"]))

    update, _, _ = one_window(documented, micro_batch_tokens=48, pack=True)
    now = status(lambda: one_window(documented, micro_batch_tokens=48, pack=True))
    out.append(
        ("`pack=True`, plain loop, the documented call (correct)", now, f"{_rel(update, want):.1e}")
    )
    return out


# -- 3, 4. the window size in the wrong unit ----------------------------------------------------


def _window_size_rows(batch: Any, want: torch.Tensor) -> list[Row]:
    micros = micro_batches(batch)
    model, _ = model_and_batch()
    s, n = correct(model, micros[0])
    first = grad(model, s / n)  # the first step's gradient: one micro-batch's
    steps = []

    def many() -> None:
        model, _ = model_and_batch()
        with fb.Accumulator(
            model, torch.optim.SGD(model.parameters(), lr=1.0), micro_batch_size=MICRO
        ) as acc:
            for window in acc.windows(micros):
                for micro in window:
                    window.backward(*correct(model, micro))
                window.step()
            steps.append(acc.steps)

    now = status(many)
    out = [("`micro_batch_size=M`, loader of M-row micro-batches", now,
            f"{steps[0]} steps instead of 1; the first {_rel(first, want):.0%} off")]  # fmt: skip
    others = [batch] + [_reseeded(batch, s) for s in range(1, 4)]
    update, _, _ = one_window(_plain, loader=others, micro_batches=4)
    now = status(lambda: one_window(_plain, loader=others, micro_batches=4))
    out.append(
        (
            "`micro_batches=K`, loader of K or more whole batches",
            now + " (by design)",
            f"{_rel(update, want):.0%} (a K-times batch)",
        )
    )
    now = status(lambda: one_window(_plain, loader=others[:2], micro_batches=4))
    update, _, _ = one_window(_plain, loader=others[:2], micro_batches=4)
    out.append(
        (
            "`micro_batches=K`, loader of fewer than K whole batches",
            now,
            f"{_rel(update, want):.0%}",
        )
    )
    return out


def _reseeded(batch: Any, seed: int) -> Any:
    g = torch.Generator().manual_seed(seed)
    mask = batch["attention_mask"]
    ids = torch.randint(1, 64, mask.shape, generator=g) * mask
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORE)}


# -- 5-8. the loss helpers and window.backward -------------------------------------------------


def _loss_rows(batch: Any, want: torch.Tensor) -> list[Row]:
    out = []
    no_mask = {"input_ids": batch["input_ids"], "labels": batch["input_ids"].clone()}

    def no_mask_term(m: Any, micro: Any) -> Any:
        return fb.causal_lm_loss(m(input_ids=micro["input_ids"]).logits, micro["labels"])

    got = emulated(no_mask, no_mask_term)
    now = status(
        lambda: one_window(lambda m, w, mi: w.backward(*no_mask_term(m, mi)), batch=no_mask)
    )
    out.append(
        (
            "pad-id labels, batch without `attention_mask`",
            now,
            f"{_rel(got, want):.0%}, cos {_cos(got, want):.2f}",
        )
    )

    def sliced(m: Any, micro: Any) -> Any:
        return fb.causal_lm_loss(logits(m, micro)[:, :-1], micro["labels"][:, 1:])

    def copied(m: Any, micro: Any) -> Any:
        return fb.causal_lm_loss(
            logits(m, micro)[:, :-1].contiguous(), micro["labels"][:, 1:].contiguous()
        )

    got = emulated(batch, copied)
    for name, term in (
        ("`logits[:, :-1]`, `labels[:, 1:]`", sliced),
        ("the same, copied (`.contiguous()`)", copied),
    ):
        now = status(lambda term=term: one_window(lambda m, w, mi: w.backward(*term(m, mi))))
        out.append(
            (
                f"{name} passed to `causal_lm_loss`",
                now,
                f"{_rel(got, want):.0%}, cos {_cos(got, want):.2f}",
            )
        )

    for name, every in (("again with `count=0`", True), ("on some micro-batches", False)):
        seen: list[int] = []

        def twice(m: Any, w: Any, micro: Any, every: bool = every, seen: list[int] = seen) -> None:
            s, n = correct(m, micro)
            seen.append(1)
            if every or len(seen) % 2:
                w.backward(s, n, retain_graph=True)
                w.backward(s, 0)
            else:
                w.backward(s, n)

        k = [0]

        def term(m: Any, micro: Any, every: bool = every, k: list[int] = k) -> Any:
            s, n = correct(m, micro)
            k[0] += 1
            return (2 * s if every or k[0] % 2 else s), n

        got = emulated(batch, term)
        now = status(lambda twice=twice: one_window(twice))
        out.append((f"the same loss backpropagated twice, {name}", now, f"{_rel(got, want):.0%}"))

    counts = {"tokens": lambda m: fb.count_tokens(m["labels"])}

    def own_count(m: Any, w: Any, micro: Any) -> None:
        _ = w.totals
        s, n = correct(m, micro)
        w.backward(s / n)

    update, _, _ = one_window(own_count, micro_batch_size=MICRO, counts=counts)
    now = status(lambda: one_window(own_count, micro_batch_size=MICRO, counts=counts))

    def own(model: Any, micro: Any, totals: Any) -> Any:
        s, n = correct(model, micro)
        return s / n

    report = fb.verify(model_and_batch()[0], batch, own, micro_batch_size=MICRO, counts=counts)
    verdict = "PASSED" if report.passed else "FAILED"
    out.append(
        (
            "share divided by the micro-batch's own count, not `window.totals`",
            f"{now} (by design); `fb.verify(counts=)`: {verdict}",
            f"{_rel(update, want):.0%}",
        )
    )
    return out


# -- 9, 10. rows joined or trimmed --------------------------------------------------------------


def _prompts(seed: int, lengths: list[int], width: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.randint(1, 64, (n,), generator=g)
        mask[row, width - n :] = 1
    done = torch.randint(1, 64, (len(lengths), 4), generator=g)
    return {
        "prompt_ids": ids,
        "prompt_mask": mask,
        "completion_ids": done,
        "completion_mask": torch.ones_like(done),
    }


def _completion_loss(model: Any, w: Any) -> torch.Tensor:
    ids = torch.cat([w["prompt_ids"], w["completion_ids"]], 1)
    mask = torch.cat([w["prompt_mask"], w["completion_mask"]], 1)
    c = w["completion_ids"].shape[1]
    out = model(input_ids=ids, attention_mask=mask).logits[:, -c - 1 : -1]
    return F.cross_entropy(out.flatten(0, 1), w["completion_ids"].flatten(), reduction="sum")


def _splitting_rows(batch: Any) -> list[Row]:
    a, b = _prompts(1, [3, 5], 5), _prompts(2, [4, 7], 7)
    right = next(fb.row_windows([a, b], rows=4, left=("prompt_ids", "prompt_mask")))
    old = {
        k: torch.cat([F.pad(a[k], (0, 2)), b[k]])
        if k.startswith("prompt")
        else torch.cat([a[k], b[k]])
        for k in a
    }
    model, _ = model_and_batch()
    error = _rel(
        grad(model, _completion_loss(model, old)), grad(model, _completion_loss(model, right))
    )
    now = status(lambda: next(fb.row_windows([a, b], rows=4)))
    out = [
        (
            "`fb.row_windows` joining left-padded prompts without `left=`",
            now,
            f"{error:.0%} on the joined window",
        )
    ]

    g = torch.Generator().manual_seed(3)
    styled = {
        **batch,
        "style": torch.rand(batch["input_ids"].shape, generator=g, dtype=torch.float64),
    }

    def weighted(m: Any, micro: Any) -> Any:
        out_ = logits(m, micro)[:, :-1]
        per = F.cross_entropy(
            out_.transpose(1, 2), micro["labels"][:, 1:], ignore_index=IGNORE, reduction="none"
        ).sum(1)
        return (per * micro["style"].mean(1)).sum(), (micro["labels"][:, 1:] != IGNORE).sum()

    model, _ = model_and_batch()
    s, n = weighted(model, styled)
    want = grad(model, s / n)
    keys = ("input_ids", "attention_mask", "labels", "style")  # declared per token: the old trim
    old_update, _, _ = one_window(
        lambda m, w, mi: w.backward(*weighted(m, mi)),
        batch=styled,
        micro_batch_tokens=48,
        token_keys=keys,
    )
    now = status(
        lambda: one_window(
            lambda m, w, mi: w.backward(*weighted(m, mi)), batch=styled, micro_batch_tokens=48
        )
    )
    out.append(
        (
            "`micro_batch_tokens`: a per-row `[rows, W]` tensor, W = the padded width",
            now,
            f"{_rel(old_update, want):.1%} (trimmed as before)",
        )
    )
    return out


# -- 11. the optimizer re-created -------------------------------------------------------------


def _optimizer_rows(want: torch.Tensor) -> list[Row]:
    def recreated(step_new: bool) -> Callable[[], Any]:
        def run() -> Any:
            model, batch = model_and_batch()
            before = _flat(model)
            acc = fb.Accumulator(
                model, torch.optim.SGD(model.parameters(), lr=0.5), micro_batch_size=MICRO
            )
            new = torch.optim.SGD(model.parameters(), lr=1.0)  # re-created with the intended LR
            try:
                for window in acc.windows([batch]):
                    for micro in window:
                        window.backward(*correct(model, micro))
                    stats = window.step()
                    if step_new:
                        new.step()
            finally:
                acc.close()
            return before - _flat(model), stats

        return run

    update, stats = recreated(False)()
    now = status(recreated(False)) + " (by design: `stats.lr` shows the LR used)"
    error = f"{_rel(update, want):.0%} (lr {stats.lr} stepped instead of 1.0)"
    out = [("optimizer re-created after the Accumulator, never stepped", now, error)]
    out.append(
        (
            "optimizer re-created, and stepped in the loop",
            status(recreated(True)),
            "its LR never applies",
        )
    )

    def scheduler_run() -> None:
        model, _ = model_and_batch()
        old = torch.optim.SGD(model.parameters(), lr=0.5)
        sched = torch.optim.lr_scheduler.StepLR(old, step_size=1)
        fb.Accumulator(
            model,
            torch.optim.SGD(model.parameters(), lr=1.0),
            micro_batch_size=MICRO,
            scheduler=sched,
        ).close()

    out.append(
        (
            "optimizer re-created after its scheduler, `scheduler=` given",
            status(scheduler_run),
            "the schedule never applies",
        )
    )
    return out


# -- 12. the count's unit -----------------------------------------------------------------------


def _unit_rows(batch: Any, want: torch.Tensor) -> list[Row]:
    n_total = float(correct(model_and_batch()[0], batch)[1])
    units = {
        "rows": lambda s, n, mi: (s, mi["input_ids"].shape[0]),
        "`numel`": lambda s, n, mi: (s, mi["input_ids"].numel()),
        "the batch total": lambda s, n, mi: (s, n_total),
        "a leftover `/K`": lambda s, n, mi: (s / 4, n),
    }
    parts, now = [], "silent"
    for name, unit in units.items():

        def body(m: Any, w: Any, mi: Any, unit: Any = unit) -> None:
            w.backward(*unit(*correct(m, mi), mi))

        update, _, _ = one_window(body)
        now = status(lambda body=body: one_window(body))
        parts.append(f"{name} ×{float(update.norm() / want.norm()):.2f}")
    cos = _cos(update, want)
    return [
        (
            "count in the wrong unit (rows, `numel`, the batch total, a leftover `/K`)",
            now + " (by design)",
            ", ".join(parts) + f"; cos {cos:.3f}",
        )
    ]


# -- 13. a GradScaler's scale in the loss; a class-weighted loss's count ---------------------------


def _scaler_row(batch: Any, want: torch.Tensor) -> Row:
    """``window.backward(scaler.scale(loss_sum), n)`` without ``scaler=``."""
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)

    def body(m: Any, w: Any, mi: Any) -> None:
        s, n = correct(m, mi)
        w.backward(scaler.scale(s), n)

    now = status(lambda: one_window(body))
    update = emulated(batch, lambda m, mi: (scaler.scale(correct(m, mi)[0]), correct(m, mi)[1]))
    return (
        "`window.backward(scaler.scale(loss_sum), n)` without `scaler=` (GradScaler, scale 256)",
        now,
        f"×{float(update.norm() / want.norm()):.0f} ({_rel(update, want):.0%})",
    )


#: Class weights over the vocabulary (a weighted token loss), in the loss's dtype.
_WEIGHTS = torch.linspace(0.1, 1.0, 64, dtype=torch.float64)


def weighted(m: Any, micro: Any, count: str = "weights") -> tuple[torch.Tensor, Any]:
    """``F.cross_entropy(weight=w, reduction="sum")`` over the shifted tokens, with the weights'
    sum as its count (``count="tokens"``: the unweighted count, the mistake)."""
    out, labels = logits(m, micro)[:, :-1].flatten(0, 1), micro["labels"][:, 1:].flatten()
    loss_sum = F.cross_entropy(out, labels, weight=_WEIGHTS, reduction="sum", ignore_index=IGNORE)
    kept = labels[labels != IGNORE]
    return loss_sum, _WEIGHTS[kept].sum() if count == "weights" else kept.numel()


def _weighted_row(batch: Any) -> Row:
    model, _ = model_and_batch()
    out, labels = logits(model, batch)[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten()
    want = grad(model, F.cross_entropy(out, labels, weight=_WEIGHTS, ignore_index=IGNORE))

    def body(m: Any, w: Any, mi: Any) -> None:
        w.backward(*weighted(m, mi, "tokens"))

    now = status(lambda: one_window(body))
    with fb.probe(objective=weighted, windows=1) as probe:
        update, _, _ = one_window(body)
    check = probe.report.windows[0]
    says = f"{'right' if check.ok else 'WRONG'}, {check.pattern} ×{check.factor:.2f}"
    return (
        "class-weighted cross-entropy (`weight=w`, summed) passed with the unweighted count",
        f"{now} (by design); `fb.probe(objective=` weighted sum, weights' sum`)`: {says}",
        f"{_rel(update, want):.0%} (×{float(update.norm() / want.norm()):.2f}, cos "
        f"{_cos(update, want):.3f})",
    )

"""``fb.verify``: prove, on the user's own model and batch, that fullbatch equals the full batch.

Three gradients from the same parameters: the plain full-batch reference (``loss_sum / count``,
one backward), one window of the real :class:`fullbatch.Accumulator`, and the naive recipe
(each micro-batch's mean divided by the number of micro-batches) for contrast. An additivity
check tells whether the loss can be accumulated exactly at all, and names what breaks it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from fullbatch._base._modelstate import ModelSnapshot, disable_dropout
from fullbatch._base._split import count_rows
from fullbatch._proof._reorder import reverse_rows
from fullbatch._verify._additivity import check_additivity
from fullbatch._verify._arms import (
    LossFn,
    compare,
    full_batch_arm,
    fullbatch_arm,
    naive_arm,
)
from fullbatch._verify._declared import DeclaredCounts
from fullbatch._verify._precision import (
    TOLERANCES,
    check_autocast,
    dtype_name,
    under_autocast,
    widen_tolerance,
    working_copy,
)
from fullbatch._verify._share import ShareForm
from fullbatch._verify._verdict import Runs, build_report

__all__ = ["verify"]


def _check_arguments(model: Any, loss_fn: Any, micro_batch_size: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
    if not callable(loss_fn):
        raise TypeError(
            f"loss_fn must be callable as loss_fn(model, micro) -> (loss_sum, count), got "
            f"{type(loss_fn).__name__}."
        )
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int):
        raise ValueError(f"micro_batch_size must be a positive int, got {micro_batch_size!r}.")
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be a positive int, got {micro_batch_size}.")


def _check_split(rows: int, micro_batch_size: int) -> None:
    """Refuse a comparison that cannot fail: one micro-batch accumulates nothing."""
    if rows < 2:
        raise ValueError(
            f"the batch has {rows} row: verify needs at least 2 rows to split into "
            "micro-batches; pass a batch of several rows."
        )
    if micro_batch_size >= rows:
        raise ValueError(
            f"micro_batch_size {micro_batch_size} >= the batch's {rows} rows: a single "
            "micro-batch, so fullbatch accumulates nothing and the comparison proves nothing; "
            f"pass micro_batch_size={rows // 2} or smaller (2 micro-batches or more), or a "
            "batch with more rows."
        )


def verify(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    *,
    micro_batch_size: int | None = None,
    dtype: torch.dtype | None = None,
    autocast: torch.dtype | None = None,
    rtol: float | None = None,
    counts: Mapping[str, Callable[[Any], Any]] | None = None,
    micro_batch_tokens: int | None = None,
    pack: bool = False,
    objective: str | Callable[..., Any] | None = None,
    moe: bool = False,
) -> Any:
    """Check that fullbatch's accumulated gradient equals the full-batch gradient.

    One step from the model's current parameters is computed three ways on ``batch``: the
    whole batch at once (the reference), one window of :class:`fullbatch.Accumulator` with
    ``micro_batch_size`` rows per micro-batch, and the naive ``loss / K`` recipe. Dropout is
    switched off completely during the comparison: ``p = 0`` on every dropout module (some
    modules apply ``dropout.p`` at their own training flag, e.g. GPT-2's attention), eval mode,
    and float dropout attributes set to 0; the report's notes list each change, and all of it is
    restored afterwards. Leftover randomness is detected by evaluating the full batch twice.

    The model is left exactly as it was: parameters are never written; gradients,
    ``requires_grad``, training flags, buffers (BatchNorm statistics) and the torch RNG state
    (CPU and CUDA) are restored.

    Args:
        model: the model, with the parameters to test from.
        batch: one batch, a tensor or a dict of tensors with rows first (as a loader yields).
        loss_fn: ``loss_fn(model, micro) -> (loss_sum, count)``: the loss *summed* over the
            micro-batch's items and how many items that is (see ``fb.cross_entropy_sum``).
        micro_batch_size: rows per micro-batch, smaller than the batch's rows (at least two
            micro-batches; pick one that makes several).
        dtype: compare on a copy in this dtype (e.g. ``torch.float64`` for a tight check).
            By default the model's dtype; bfloat16/float16 models are compared on a float32
            copy when it fits in memory. ``torch.bfloat16`` compares a bf16 model as it trains.
        autocast: ``torch.bfloat16`` or ``torch.float16``: run every forward and ``loss_fn``
            under ``torch.autocast`` in that dtype (on the parameters' device type), as mixed
            precision training does; backward runs outside it. ``None`` (default): as
            ``loss_fn`` does it (an autocast inside ``loss_fn`` works too).
        counts: the Accumulator's ``counts=`` (``{name: fn(micro) -> number}``) to check the
            share form: ``loss_fn(model, micro, totals)`` then returns the 0-dim share
            ``loss_sum / totals[name]`` that ``window.backward(share)`` takes. The fullbatch
            arm runs ``counts=`` and ``window.backward(share)``; verify also checks that the
            share scales as ``1 / totals`` (a share not divided by ``window.totals``, or
            divided by the micro-batch's own count, fails with that diagnosis).
        objective: the objective ``loss_fn`` is meant to compute: ``"causal_lm"``,
            ``"token"``, ``"sample"`` or ``fn(model, micro) -> (loss_sum, count)`` (as in
            :func:`fullbatch.probe`). Every count ``loss_fn`` returns is compared with the
            objective's count of the same rows: a count in another unit (rows, ``numel``, the
            batch total, a leftover ``/ K``) trains every step scaled and is self-consistent,
            so only a declared objective can fail it. ``None``: not checked.
        moe: ``True`` for a transformers MoE model (``loss_fn=None``: the model's own loss,
            cross-entropy plus ``router_aux_loss_coef`` times the load-balancing loss of the
            whole batch): returns a ``MoEReport`` with the gradient error of each way to
            accumulate it (exact with ``window.stats``, the running mean, per micro-batch);
            docs/moe.md.
        rtol: relative tolerance; by default 1e-10 for float64, 1e-5 for float32, 2e-2 for
            bfloat16 and 2e-3 for float16, widened to the model's own rounding band when that
            is larger (see below). An explicit ``rtol`` is never widened.

    Low precision (bf16/fp16 autocast, bf16/fp16 parameters, float32 internals of a float64
    model): the full batch itself is only defined up to rounding there. verify measures the
    model's own *rounding band*, how far the full batch's gradient moves when its loss is
    normalized after backward (scaled by fullbatch's ``c`` before backward, divided by ``c·N``
    after) instead of before, or its rows are permuted, and holds fullbatch
    to 4 times that band (the report's notes state the band and the tolerance). Measured on
    tiny Llama and GPT-2: bands of 8e-3 to 4e-2 relative in bfloat16 and 1e-3 to 1e-2 in
    float16 (autocast or low-precision parameters), fullbatch's error 0.7 to 1.4 times the
    band. A mean-reduced loss or a constant count still fails (the additivity check), but
    differences below the widened tolerance are not resolved: with nearly equal counts per
    micro-batch even the naive ``loss / K`` recipe can fall inside it (the notes then say so).
    Such a pass means "equal up to this precision's rounding", not more: for a tight proof
    compare in float32 (the default for bf16/fp16 models) or float64.

        micro_batch_tokens, pack: ``pack=True`` with ``micro_batch_tokens=T`` (and no
            ``micro_batch_size``) checks padding-free packing instead: ``batch`` (right-padded
            rows with an ``attention_mask``) is packed as ``Accumulator(...,
            micro_batch_tokens=T, pack=True)`` packs it, and ``loss_fn`` runs on the packed
            micro-batches and on the same rows padded, from the same parameters. It passes
            when the gradients agree within 10 times a measured rounding band (the padded
            rows regrouped) and a leak probe finds exactly zero gradient of one row's loss on
            another row's input embeddings; otherwise the report names the likely cause (the
            cache left on, a 2-D mask, an encoder that ignores ``position_ids``, a model
            without ``position_ids``, a sliding window). ``autocast`` and ``rtol`` do not
            apply there.

    Returns:
        A :class:`VerifyReport`: ``.passed``, ``.diagnosis`` and a readable ``str()``; with
        ``pack=True`` a ``PackingReport`` (``.passed``, ``.causes``, ``.grad_error``,
        ``.leak``, ``str()``).

    Raises:
        TypeError, ValueError: bad arguments, or ``loss_fn`` not returning ``(loss_sum, count)``.
        ValueError: ``micro_batch_size`` >= the batch's rows (or a one-row batch). One
            micro-batch accumulates nothing, so fullbatch equals the full batch trivially;
            a report saying PASSED would be read (``assert report.passed``) as a proof it is
            not, so verify refuses rather than returning one.

    >>> import torch, fullbatch as fb
    >>> model = torch.nn.Linear(4, 3).double()
    >>> batch = {"x": torch.randn(6, 4, dtype=torch.float64), "y": torch.tensor([0, 1, 2, 0, 1, 2])}
    >>> loss_fn = lambda m, b: fb.cross_entropy_sum(m(b["x"]), b["y"])
    >>> fb.verify(model, batch, loss_fn, micro_batch_size=4).passed
    True
    """
    if moe:
        if loss_fn is not None:
            raise ValueError(
                "verify(..., moe=True) checks the model's own loss: pass loss_fn=None."
            )
        from fullbatch._verify._moe import verify_moe

        return verify_moe(model, batch, micro_batch_size=micro_batch_size, rtol=rtol)
    if pack is not False or micro_batch_tokens is not None:
        return _verify_packing(
            model, batch, loss_fn, micro_batch_size, micro_batch_tokens, pack, dtype, autocast
        )
    _check_arguments(model, loss_fn, micro_batch_size)
    assert isinstance(micro_batch_size, int)
    declared = None
    if objective is not None:
        if counts is not None:
            raise ValueError(
                "objective= checks the counts loss_fn returns (the count form); with counts= "
                "loss_fn returns shares, which verify checks against window.totals already."
            )
        declared = DeclaredCounts(objective)
        loss_fn = declared.wrap(loss_fn)
    autocast = check_autocast(autocast)
    rows = count_rows(batch)
    _check_split(rows, micro_batch_size)
    notes: list[str] = []
    snapshot = ModelSnapshot.capture(model)
    dropout = None
    try:
        with torch.enable_grad():
            work, work_batch, compute_dtype = working_copy(model, batch, dtype, notes)
            compute = dtype_name(compute_dtype)
            device_type = next(work.parameters()).device.type
            share = None
            if counts is not None:  # the share form: see _share.py
                amp = None if autocast is None else (device_type, autocast)
                share = ShareForm(loss_fn, counts, work_batch, autocast=amp)  # type: ignore[arg-type]
                loss_fn = share.count_form
                notes.append(f"share form: counts= totals over the batch {share.totals}")
            if autocast is not None:
                loss_fn = under_autocast(loss_fn, device_type, autocast)
                compute += f" + {dtype_name(autocast)} autocast"
            dropout = disable_dropout(work)
            notes += [f"disabled for the comparison: {line}" for line in dropout.describe()]
            runs = _run_arms(work, work_batch, loss_fn, micro_batch_size, notes, share)
            tol = rtol if rtol is not None else TOLERANCES[compute_dtype]
            if rtol is None:
                tol = widen_tolerance(tol, runs.band, runs.nondeterminism, compute, notes)
            additivity = check_additivity(work, work_batch, loss_fn, tol)
            cause = None if share is None else share.scaling_cause(work, work_batch, tol)
            unit = None if declared is None else declared.cause(work)
        report = build_report(runs, additivity, tol, compute, rows, micro_batch_size, notes)
        causes = [c for c in (cause, unit) if c is not None]
        if causes:
            report = dataclasses.replace(
                report, passed=False, diagnosis=[*report.diagnosis, *causes]
            )
        return report
    finally:
        if dropout is not None:
            dropout.restore()
        snapshot.restore()


def _verify_packing(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    micro_batch_size: Any,
    micro_batch_tokens: Any,
    pack: Any,
    dtype: torch.dtype | None,
    autocast: Any,
) -> Any:
    if pack is not True or micro_batch_size is not None or autocast is not None:
        raise ValueError(
            "verify checks padding-free packing with pack=True and micro_batch_tokens=T "
            "(no micro_batch_size, no autocast), and fullbatch's accumulation with "
            f"micro_batch_size=M; got pack={pack!r}, micro_batch_tokens={micro_batch_tokens!r}, "
            f"micro_batch_size={micro_batch_size!r}, autocast={autocast!r}."
        )
    from fullbatch._verify._pack_run import verify_packing

    return verify_packing(model, batch, loss_fn, micro_batch_tokens=micro_batch_tokens, dtype=dtype)


def _run_arms(
    work: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    micro_batch_size: int,
    notes: list[str],
    share: ShareForm | None = None,
) -> Runs:
    """Run every arm on ``work``, with its buffers reset to their start values in between."""
    params = [(n, p) for n, p in work.named_parameters() if p.requires_grad]
    start = ModelSnapshot.capture(work)  # only its buffers are used
    try:
        ref = full_batch_arm(work, params, batch, loss_fn)
        if ref.count == 0:
            raise ValueError(
                "the batch counts 0 items (every label ignored?): nothing to compare; pass a "
                "batch for which loss_fn returns a positive count."
            )
        start.restore_buffers()
        again = full_batch_arm(work, params, batch, loss_fn)
        start.restore_buffers()
        permuted = full_batch_arm(work, params, reverse_rows(batch, count_rows(batch)), loss_fn)
        start.restore_buffers()
        fullbatch = fullbatch_arm(work, params, batch, loss_fn, micro_batch_size, share)
        start.restore_buffers()
        # the full batch with its loss scaled before backward as fullbatch scales it
        after = full_batch_arm(work, params, batch, loss_fn, scale_before=fullbatch.loss_scale)
        start.restore_buffers()
        naive = naive_arm(work, params, batch, loss_fn, micro_batch_size)
    finally:
        start.restore_buffers()
    notes += fullbatch.warnings
    return Runs(
        ref=ref,
        fullbatch=fullbatch,
        naive=naive,
        nondeterminism=compare(ref.grads, again.grads)[0],
        after=compare(ref.grads, after.grads)[0],
        permuted=compare(ref.grads, permuted.grads)[0],
    )

"""Does packing respect the row boundaries on this model? Measured, not assumed.

Packed micro-batches (one packed row each, see :mod:`fullbatch._base._packed`) are compared with the
same rows run padded (unpacked from the packed row: right-padded, with an ``attention_mask``),
from the same parameters, through the user's own loss function:

- **gradient**: ``‖g_packed - g_padded‖ / ‖g_padded‖`` against a measured rounding band, the
  same distance between two exact regroupings of the padded rows (grouped as packed, and every
  row alone). Tolerance: 10 times the band (at least 10 machine epsilons of the loss).
- **leak probe**: the loss of one row alone (every other label ``-100``) must have a gradient
  of exactly zero on every other row's input embeddings (the outputs of the model's
  ``nn.Embedding`` modules). The last row probes leaks from earlier rows (causal masks), the
  first row leaks from later rows (bidirectional encoders).

When the check fails, the call the loss function made to the model tells the likely cause: the
cache left on, a 2-D or 4-D mask passed, ``position_ids`` not passed, an encoder whose attention
ignores ``position_ids``, a model without ``position_ids``, a sliding window.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fullbatch._base._packed import IGNORE

__all__ = ["PackingReport", "check_packed", "likely_causes", "repack", "unpack"]

Call = Callable[[Any], Any]  # micro -> (loss_sum, count)
_BUILT = ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


@dataclass(frozen=True)
class PackingReport:
    """Whether packing respects row boundaries on a model (:func:`fullbatch.verify` with
    ``pack=True``, and the first packed window of :meth:`Window.run`).

    Attributes:
        passed: gradient within tolerance and no leak found.
        grad_error: ``‖g_packed - g_padded‖ / ‖g_padded‖`` over the checked micro-batches.
        band: the rounding band, ``‖g_padded - g_alone‖ / ‖g_padded‖`` (rows regrouped).
        tolerance: what ``grad_error`` is held to.
        leak: the largest ``|gradient|`` of one row's loss on another row's input embeddings
            (must be exactly 0); ``None`` when it could not be probed (see ``notes``).
        causes: the likely causes of a failure, each with its fix (empty when passed).
        notes: what was checked and how.
    """

    passed: bool
    grad_error: float
    band: float
    tolerance: float
    leak: float | None
    causes: tuple[str, ...]
    notes: tuple[str, ...]

    @property
    def diagnosis(self) -> list[str]:
        """The likely causes (as ``VerifyReport.diagnosis``)."""
        return list(self.causes)

    def __str__(self) -> str:
        verdict = "PASSED" if self.passed else "FAILED"
        leak = "not probed" if self.leak is None else f"{self.leak:.1e} (must be 0)"
        lines = [
            f"packing check: {verdict}",
            f"  gradient, packed vs padded rows: {self.grad_error:.1e} "
            f"(tolerance {self.tolerance:.1e} = 10 x rounding band {self.band:.1e})",
            f"  leak across rows: {leak}",
        ]
        lines += [f"  likely cause: {c}" for c in self.causes]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _sizes(micro: dict[str, Any]) -> list[int]:
    bounds = micro["cu_seq_lens_q"].tolist()
    return [b - a for a, b in itertools.pairwise(bounds)]


def unpack(micro: dict[str, Any], rows: Sequence[int] | None = None) -> dict[str, Any]:
    """The rows of a packed micro-batch, right-padded, with an ``attention_mask`` and
    ``position_ids`` (``0..width-1`` on every row, as a model builds them by default).

    >>> from fullbatch._base._packed import RowPacker
    >>> mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    >>> packed = RowPacker(micro_batch_tokens=9)({"input_ids": mask * 5, "attention_mask": mask})
    >>> unpack(packed[0])["input_ids"].tolist()
    [[5, 5, 5], [5, 5, 0]]
    """
    sizes = _sizes(micro)
    n = sum(sizes)
    rows = list(range(len(sizes))) if rows is None else list(rows)
    width = max(sizes[r] for r in rows)
    out: dict[str, Any] = {}
    for key, value in micro.items():
        if key in _BUILT:
            continue
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == (1, n):
            pieces = value[0].split(sizes)
            fill = IGNORE if key == "labels" else 0
            padded = value.new_full((len(rows), width, *value.shape[2:]), fill)
            for i, r in enumerate(rows):
                padded[i, : sizes[r]] = pieces[r]
            out[key] = padded
        else:
            out[key] = value
    device = micro["cu_seq_lens_q"].device
    lengths = torch.tensor([sizes[r] for r in rows], device=device)
    positions = torch.arange(width, device=device)
    out["attention_mask"] = (positions < lengths[:, None]).long()
    out["position_ids"] = positions.expand(len(rows), width)
    return out


def repack(micro: dict[str, Any], rows: Sequence[int]) -> dict[str, Any]:
    """A packed micro-batch of some of ``micro``'s rows (in the order given).

    >>> from fullbatch._base._packed import RowPacker
    >>> mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    >>> packed = RowPacker(micro_batch_tokens=9)({"input_ids": mask * 5, "attention_mask": mask})
    >>> repack(packed[0], [1, 2])["position_ids"].tolist()
    [[0, 1, 0]]
    """
    sizes = _sizes(micro)
    n = sum(sizes)
    bounds = micro["cu_seq_lens_q"].tolist()
    keep = [sizes[r] for r in rows]
    out: dict[str, Any] = {}
    for key, value in micro.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == (1, n):
            out[key] = torch.cat([value[:, bounds[r] : bounds[r + 1]] for r in rows], dim=1)
        else:
            out[key] = value
    device = micro["cu_seq_lens_q"].device
    cu = torch.zeros(len(keep) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(keep).cumsum(0)
    out["cu_seq_lens_q"], out["cu_seq_lens_k"] = cu.to(device), cu.clone().to(device)
    out["max_length_q"] = out["max_length_k"] = max(keep)
    return out


class _Calls:
    """Records the keyword arguments of the loss function's first call to the model."""

    def __init__(self, model: nn.Module) -> None:
        self.kwargs: dict[str, Any] | None = None
        self.positional = 0
        self._handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if self.kwargs is None:
            self.kwargs, self.positional = dict(kwargs), len(args)

    def remove(self) -> None:
        self._handle.remove()


@contextmanager
def _embeddings(model: nn.Module, n: int) -> Iterator[list[torch.Tensor]]:
    """Each ``nn.Embedding`` output of shape ``[1, n, ...]``, made a leaf that takes gradients."""
    seen: list[torch.Tensor] = []

    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        if isinstance(output, torch.Tensor) and output.dim() >= 2 and output.shape[:2] == (1, n):
            leaf = output.detach().requires_grad_()
            seen.append(leaf)
            return leaf
        return None

    handles = [
        m.register_forward_hook(hook) for m in model.modules() if isinstance(m, nn.Embedding)
    ]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def _grad(call: Call, micros: list[dict[str, Any]], params: Sequence[torch.Tensor]) -> torch.Tensor:
    grads: list[torch.Tensor] | None = None
    for micro in micros:
        loss, _ = call(micro)
        got = torch.autograd.grad(loss, params, allow_unused=True)
        flat = [
            (g if g is not None else torch.zeros_like(p)).detach().reshape(-1).double().cpu()
            for g, p in zip(got, params, strict=True)
        ]
        grads = flat if grads is None else [a + b for a, b in zip(grads, flat, strict=True)]
    assert grads is not None
    return torch.cat(grads)


def _probe(model: nn.Module, call: Call, micro: dict[str, Any], row: int) -> float | None:
    """Largest |gradient| of row ``row``'s loss on the other rows' embeddings; None: no probe."""
    sizes = _sizes(micro)
    n = sum(sizes)
    start = sum(sizes[:row])
    labels = micro["labels"]
    keep = torch.zeros(n, dtype=torch.bool, device=labels.device)
    keep[start : start + sizes[row]] = True
    probe = dict(micro, labels=labels.masked_fill(~keep[None], IGNORE))
    _, full_count = call(micro)
    with _embeddings(model, n) as seen:
        loss, count = call(probe)
        if not seen or float(count) == 0 or float(count) == float(full_count):
            return None
        grads = torch.autograd.grad(loss, seen, allow_unused=True)
    worst = 0.0
    for g in grads:
        if g is not None:
            worst = max(worst, float(g[0][~keep].abs().max()) if n > sizes[row] else 0.0)
    return worst


def _probes(model: nn.Module, call: Call, micro: dict[str, Any]) -> tuple[Any, Any]:
    """``(first row's probe, last probed row's)``: the last row whose labels count anything."""
    rows = len(_sizes(micro))
    last = None
    for r in range(rows - 1, 0, -1):
        last = _probe(model, call, micro, r)
        if last is not None:
            break
    return _probe(model, call, micro, 0), last


def check_packed(
    model: nn.Module, call: Call, micros: list[dict[str, Any]], *, limit: int | None = None
) -> PackingReport | None:
    """Compare packed micro-batches with their rows padded; ``None`` when no micro-batch
    holds two rows (nothing could leak, nothing is checked).

    ``call(micro) -> (loss_sum, count)`` runs the user's loss; gradients are taken with
    :func:`torch.autograd.grad`, so ``.grad`` is never written. ``limit``: micro-batches checked.
    """
    multi = [m for m in micros if len(_sizes(m)) >= 2][:limit]
    if not multi:
        return None
    params = [p for p in model.parameters() if p.requires_grad]
    calls = _Calls(model)
    notes: list[str] = []
    try:
        try:
            packed = _grad(call, multi, params)
        except TypeError as refused:
            return _cannot(model, refused)
        padded = _grad(call, [unpack(m) for m in multi], params)
        alone = _grad(call, [unpack(m, [r]) for m in multi for r in range(len(_sizes(m)))], params)
        probes = [p for m in multi for p in _probes(model, call, m)]
    finally:
        calls.remove()
    norm = float(padded.norm()) or 1.0
    error = float((packed - padded).norm()) / norm
    band = float((alone - padded).norm()) / norm
    eps = torch.finfo(next(iter(params)).dtype).eps if params else 2.0**-52
    tol = max(10 * band, 10 * eps)
    known = [p for p in probes if p is not None]
    leak = max(known) if known else None
    if leak is None:
        notes.append(
            "leak probe skipped: the loss function's count did not change when every label "
            "but one row's was -100 (it does not read micro['labels']?) or the model has no "
            "nn.Embedding; only the gradient was compared"
        )
    back = probes[0::2]
    from_later = any(p is not None and p > 0 for p in back)
    rows = sum(len(_sizes(m)) for m in multi)
    notes.append(f"checked {len(multi)} packed micro-batch(es) holding {rows} rows")
    passed = error <= tol and (leak is None or leak == 0.0)
    causes = () if passed else tuple(likely_causes(model, calls.kwargs, multi, from_later))
    return PackingReport(passed, error, band, tol, leak, causes, tuple(notes))


def _config(model: nn.Module) -> Any:
    inner = getattr(model, "module", model)
    return getattr(inner, "config", None)


def _cannot(model: nn.Module, error: TypeError) -> PackingReport:
    cause = (
        f"a model without position_ids or packed-sequence keys: calling it on a packed "
        f"micro-batch raised TypeError ({error}). Such a model (BLOOM, MPT, T5, XLNet, Mamba, "
        "most custom modules) cannot pack; use pack=False (sorted and trimmed rows, exact)."
    )
    nan = float("nan")
    return PackingReport(False, nan, nan, nan, None, (cause,), ())


def likely_causes(
    model: nn.Module, kwargs: dict[str, Any] | None, micros: list[dict[str, Any]], from_later: bool
) -> list[str]:
    """Why attention crossed the rows of ``micros``, each cause with its fix.

    ``kwargs``: the keyword arguments of the model call that ran on a packed micro-batch
    (None: not seen); ``from_later``: a row's loss reached *later* rows (an encoder).
    """
    if from_later:  # a causal model never lets a row's loss reach later rows, even with a leak
        return [
            "an encoder that ignores position_ids for its mask: a row's loss reaches later "
            "rows, so attention is bidirectional over the whole packed row (BERT-style "
            "encoders). It cannot pack; use pack=False (sorted and trimmed rows, exact)."
        ]
    config = _config(model)
    seen = kwargs is not None
    kwargs = kwargs or {}
    out = []
    longest = max(int(m["max_length_q"]) for m in micros)
    forward = getattr(getattr(model, "module", model), "forward", None)
    if forward is not None and "position_ids" not in inspect.signature(forward).parameters:
        out.append(
            "a model without position_ids: its forward takes no position_ids, so positions "
            "do not restart and nothing marks the row boundaries. It cannot pack; use "
            "pack=False (sorted and trimmed rows, exact)."
        )
    if kwargs.get("use_cache") is not False and getattr(config, "use_cache", False):
        out.append(
            "cache left on: the model was called without use_cache=False and its config has "
            "use_cache=True; transformers then builds a cache, and with a cache it ignores "
            "position_ids for the mask, so rows attend to each other. Call "
            "model(**{k: v for k, v in micro.items() if k != 'labels'}) (the micro-batch "
            "holds use_cache=False), or set model.config.use_cache = False."
        )
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor):
        window = getattr(config, "sliding_window", None)
        extra = (
            f" and drops the sliding window (config.sliding_window={window})"
            if mask.dim() == 4 and window
            else ""
        )
        out.append(
            f"a {mask.dim()}-D attention_mask was passed: transformers uses it instead of "
            f"the packed-sequence mask built from position_ids{extra}. Pass no "
            "attention_mask with packed micro-batches (the micro-batch holds none)."
        )
    if seen and "position_ids" not in kwargs and not out:
        out.append(
            "position_ids not passed: the model sees one long sequence. Pass "
            "micro['position_ids'] (model(**{k: v for k, v in micro.items() if k != "
            "'labels'}) does)."
        )
    window = getattr(config, "sliding_window", None)
    if not out and isinstance(window, int) and window < longest:
        out.append(
            f"a sliding window: config.sliding_window={window} is shorter than the longest "
            f"row ({longest} tokens) and the packed attention does not apply it. Use "
            "transformers' own packed-sequence mask (no attention_mask), or pack=False."
        )
    if not out:
        out.append(
            "unknown: attention crosses row boundaries on this model (a custom attention, or "
            "an attention implementation without packed-sequence support?). Use pack=False "
            "(sorted and trimmed rows, exact)."
        )
    return out

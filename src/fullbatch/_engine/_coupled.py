"""``window.run_coupled(encode, loss)``: exact accumulation for losses that couple rows.

A contrastive loss (InfoNCE, CLIP, in-batch negatives) scores every row against every other
row of the batch, so it is not a sum over micro-batches. It is a function of the
representations, though, and those are computed row by row (GradCache, Gao et al. 2021):

1. pass 1 runs ``encode`` on every micro-batch without graphs and keeps the representations
   (and the RNG state before each micro-batch);
2. ``loss(reps, rows)`` runs once on the window's representations, gathered from every rank
   in rank order, and ``G = d loss_sum / d reps`` is taken there;
3. pass 2 re-runs each micro-batch with graphs, RNG replayed (same dropout masks), and
   backpropagates its slice of ``G`` through the ordinary ``window.backward``.

The first micro-batch is not run twice: pass 1 encodes it with its graph and keeps the graph
until pass 2 backpropagates into it first, so a window of K micro-batches costs K - 1 extra
forwards, not K, and the memory peak stays one micro-batch's graph plus the representations
(the graph is held while the other micro-batches run without one). Under FSDP2, and for DDP's
first ``static_graph`` window (a synchronized backward per micro-batch), every micro-batch is
run twice: a sharded model re-gathers its parameters at each forward and DDP's static graph
records one forward per backward.

Scaling. Rank r's loss ``L_r`` touches every rank's rows, so the gradient of the global sum
``Σ_r L_r`` with respect to rank s's rows is ``Σ_r dL_r/dR[rows_s]``: one all-reduce of ``G``
gives it. Each rank backpropagates it for its own rows; the wrapper's divisor W and the
step's ``W / (c N)`` then give ``∇(Σ_r L_r) / N`` exactly as for additive losses.

Pass 2 hands ``window.backward`` the 0-dim surrogate ``d - d.detach() + share`` with
``d = Σ reps·G``: its gradient is ``G`` backpropagated, its value is ``share`` (this rank's
loss sum on its first real micro-batch, 0 elsewhere), so the reported loss, counts, seeding
by ``c``, GradScaler, skips and DDP's one sync per window are the plain loop's.

"auto" sizes go through :func:`fullbatch._engine._auto.run_auto` with both passes as one attempt: an
OOM in either pass re-runs the whole window from its start at half the size. Across ranks,
every rank agrees before each collective of the loss step (the gathers after pass 1, the
all-reduce of ``G``), so a rank out of memory in pass 1 or in ``loss`` stops the others there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fullbatch._base._rng import RngState
from fullbatch._base._stats import StepStats
from fullbatch._base._sync import Sync
from fullbatch._engine._auto import check_peers, run_auto
from fullbatch._engine._core import Handle
from fullbatch._engine._run import abandon_locally
from fullbatch._engine._state import Phase

__all__ = ["EncodeFn", "LossFn", "run_coupled"]

EncodeFn = Callable[[Any], Any]
LossFn = Callable[[Any, slice], Any]

_ENCODE_FIX = (
    "encode(micro) must return a floating-point tensor or a tuple of them, rows first and "
    "with the same number of rows, e.g. `return query_tower(micro['q']), doc_tower(micro['d'])`."
)


def _towers(out: Any, where: str) -> tuple[torch.Tensor, ...]:
    """``encode``'s output as a tuple of tensors with a common row count."""
    parts = out if isinstance(out, tuple | list) else (out,)
    if not parts or not all(isinstance(p, torch.Tensor) for p in parts):
        got = (
            type(out).__name__
            if not isinstance(out, tuple | list)
            else ("(" + ", ".join(type(p).__name__ for p in parts) + ")")
        )
        raise ValueError(f"encode returned {got} {where}. {_ENCODE_FIX}")
    shapes = [tuple(p.shape) for p in parts]
    if any(len(s) == 0 for s in shapes) or len({s[0] for s in shapes}) != 1:
        raise ValueError(f"encode returned tensors of shapes {shapes} {where}. {_ENCODE_FIX}")
    if not all(p.is_floating_point() for p in parts):
        dtypes = [str(p.dtype) for p in parts]
        raise ValueError(f"encode returned dtypes {dtypes} {where}. {_ENCODE_FIX}")
    return tuple(parts)


def _gather(sync: Sync, local: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Every rank's rows of ``local``, concatenated in rank order (ranks differ in rows)."""
    if sync.group is None:
        return local
    most = max(sizes)
    padded = local.new_zeros((most, *local.shape[1:]))
    padded[: local.shape[0]] = local
    every = sync.all_gather(padded)
    return torch.cat([every[r, :n] for r, n in enumerate(sizes)])


def _unpack_loss(out: Any) -> tuple[torch.Tensor, Any]:
    if isinstance(out, tuple | list) and len(out) == 2 and isinstance(out[0], torch.Tensor):
        loss_sum, count = out
        if loss_sum.numel() == 1:
            return loss_sum.reshape(()), count
    if isinstance(out, torch.Tensor):
        got = f"tensor of shape {tuple(out.shape)}"
    elif isinstance(out, tuple | list):
        got = f"{type(out).__name__} of length {len(out)}"
    else:
        got = type(out).__name__
    raise ValueError(
        f"loss(reps, rows) returned a {got}; return (loss_sum, count): the loss summed over "
        "this rank's rows reps[rows] and their number, e.g. "
        "`return fb.cross_entropy_sum(q[rows] @ d.T / t, torch.arange(len(d))[rows])`."
    )


def _reps_gradient(
    loss: LossFn,
    local: list[tuple[torch.Tensor, ...]],
    sync: Sync,
    agree: Callable[[], None] | None = None,
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, Any]:
    """``(G for this rank's rows, per tower; loss_sum; count)``: one loss call per window.

    ``agree`` runs before each collective ("auto": a rank out of memory stops the others there).
    """
    if agree is not None and sync.group is not None:
        agree()
    towers = len(local[0])
    mine = [torch.cat([reps[t] for reps in local]) for t in range(towers)]
    rows_here = mine[0].shape[0]
    if sync.group is None:
        sizes = [rows_here]
    else:
        counted = torch.tensor([float(rows_here)], dtype=torch.float64)
        sizes = [int(v) for v in sync.all_gather(counted).reshape(-1).tolist()]
    start = sum(sizes[: sync.rank])
    rows = slice(start, start + rows_here)
    leaves = tuple(_gather(sync, m, sizes).requires_grad_(True) for m in mine)
    with torch.enable_grad():
        loss_sum, count = _unpack_loss(loss(leaves if towers > 1 else leaves[0], rows))
        if not loss_sum.requires_grad:
            raise ValueError(
                "the loss returned by loss(reps, rows) does not require grad: compute it from "
                "reps (not from detached copies or under torch.no_grad())."
            )
        grads = torch.autograd.grad(loss_sum, leaves, allow_unused=True)
    full = [
        torch.zeros_like(leaf) if g is None else g for leaf, g in zip(leaves, grads, strict=True)
    ]
    if sync.group is not None:
        if agree is not None:
            agree()  # the loss and its gradient may have run out of memory on some rank
        # Every rank's loss touches every rank's rows: sum the gradients over ranks (one
        # all-reduce for all towers), then each rank keeps its own rows.
        dtype = full[0].dtype
        for g in full[1:]:
            dtype = torch.promote_types(dtype, g.dtype)
        flat = sync.all_reduce_sum(torch.cat([g.reshape(-1).to(dtype) for g in full]))
        pieces = flat.split([g.numel() for g in full])
        full = [p.view_as(g).to(g.dtype) for p, g in zip(pieces, full, strict=True)]
    return tuple(g[rows] for g in full), loss_sum.detach(), count


def _surrogate(reps: tuple[torch.Tensor, ...], grads: tuple[torch.Tensor, ...], share: Any) -> Any:
    """0-dim: gradient ``grads`` backpropagated through ``reps``, value ``share``."""
    dtype = torch.promote_types(grads[0].dtype, torch.float32)
    dot = sum((r.to(dtype) * g.to(dtype)).sum() for r, g in zip(reps, grads, strict=True))
    assert isinstance(dot, torch.Tensor)
    value = share.to(dtype) if isinstance(share, torch.Tensor) else dot.new_zeros(())
    return dot - dot.detach() + value


def _micro_batches(window: Handle) -> list[tuple[Any, bool]]:
    """The window's micro-batches, read ahead, with their padding flags (nothing popped)."""
    feed = window._state.feed
    feed.fill()
    return [(m, False) for m in feed.real] + [(m, True) for m in feed._padding]


def run_coupled(window: Handle, encode: EncodeFn, loss: LossFn) -> StepStats:
    """The body of :meth:`Window.run_coupled`."""
    engine = window._engine
    if window._state.phase is not Phase.OPEN:
        raise RuntimeError(
            f"window.run_coupled on window {window._state.index}, which was already iterated; call "
            "it instead of `for micro in window:`, not after."
        )
    if engine.micro_plan.is_auto:
        # An OOM in either pass re-runs the whole window (both passes) with half the size.
        # Under DDP/FSDP2 the ranks agree before each collective of the loss step.
        def runner(attempt: Handle, enc: EncodeFn, before_backward: Callable[[], None]) -> None:
            _passes(attempt, enc, loss, before_backward, lambda: check_peers(engine.sync))

        return run_auto(window, encode, runner)
    try:
        _passes(window, encode, loss)
    except BaseException:
        abandon_locally(window)
        raise
    return window.step()


def _passes(
    window: Handle,
    encode: EncodeFn,
    loss: LossFn,
    before_backward: Callable[[], None] | None = None,
    agree: Callable[[], None] | None = None,
) -> None:
    """Both passes and every backward of the window, no step (the caller abandons on error)."""
    sync = window._engine.sync
    # Pass 1: representations, and the RNG state before each micro-batch; graphs only for
    # the first micro-batch, whose graph pass 2 uses instead of running it again.
    micros = _micro_batches(window)
    keep = not sync.sharded and not sync.equal_micro_batches and not micros[0][1]
    states: list[RngState] = []
    local: list[tuple[torch.Tensor, ...]] = []
    kept: tuple[torch.Tensor, ...] | None = None
    for i, (micro, padding) in enumerate(micros):
        states.append(RngState())
        if i == 0 and keep:
            # DDP decides at forward time whether the backward synchronizes: the sync
            # state is the one pass 2 would set for this micro-batch.
            sync.begin(len(micros) == 1)
            try:
                with torch.enable_grad():
                    kept = _towers(encode(micro), "for micro-batch 0 (pass 1)")
            finally:
                sync.end()
            reps = tuple(t.detach() for t in kept)
        else:
            with torch.no_grad():
                reps = _towers(encode(micro), f"for micro-batch {i} (pass 1)")
        if not padding:
            local.append(reps)
        del reps
    if not local:
        raise RuntimeError(
            f"window {window._state.index} has no real micro-batch on this rank; "
            "window.run_coupled needs at least one row per rank."
        )
    sizes = [r[0].shape[0] for r in local]
    shapes = [tuple(t.shape[1:]) for t in local[0]]
    grads, loss_sum, count = _reps_gradient(loss, local, sync, agree)
    del local
    after_loss = RngState()
    # Pass 2: graphs, the same RNG, and each micro-batch's slice of the cached gradient.
    window._state.by_run = True
    offset, real = 0, 0
    for i, micro in enumerate(window):
        if i == 0 and kept is not None:
            reps, kept = kept, None
        else:
            states[i].restore()
            reps = _towers(encode(micro), f"for micro-batch {i} (pass 2)")
        if before_backward is not None:
            before_backward()
        if window.is_padding:
            window.backward(_surrogate(reps, tuple(torch.zeros_like(r) for r in reps), None), 0)
            continue
        got = [tuple(t.shape[1:]) for t in reps]
        if reps[0].shape[0] != sizes[real] or got != shapes:
            raise RuntimeError(
                f"encode returned different shapes for micro-batch {i} in pass 2 "
                f"({[tuple(t.shape) for t in reps]}) than in pass 1; encode must be "
                "deterministic given the RNG state (no data-dependent randomness "
                "outside torch's generators)."
            )
        n = sizes[real]
        piece = tuple(g[offset : offset + n] for g in grads)
        first = real == 0
        window.backward(_surrogate(reps, piece, loss_sum if first else None), count if first else 0)
        del reps, piece
        offset += n
        real += 1
    after_loss.restore()

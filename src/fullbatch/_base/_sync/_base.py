"""The no-op :class:`Sync` for local training, and what every kind shares.

A :class:`Sync` answers the engine's questions about the wrapper: which ranks count together
(the counting group), what the wrapper divides gradients by (``W``), how to set the wrapper's
sync state for one micro-batch, and how many ranks hold the same gradient shard
(``norm_copies``, so that a norm summed over the counting group counts each shard once). It
also runs the window's tiny collectives.

Everything else the engine needs to know about a wrapper is a capability of its
:class:`Sync` (``sharded``, ``equal_micro_batches``, ``reduce_at_step``,
``syncs_in_backward``, ``needs_wrapper_forward``, :meth:`Sync.padding`,
:meth:`Sync.held_grads`, :attr:`Sync.inner`, :meth:`Sync.no_collectives`), never its
``kind``: ``kind`` only names the wrapper in a checkpoint. A new wrapper is one module here
that subclasses :class:`Sync` and answers these, plus its line in ``_make``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fullbatch._base._normalize import squared_norm
from fullbatch._base._sync._mesh import MeshFacts

__all__ = ["Sync", "all_reduce_over", "gather_over_ranks", "sum_over_ranks", "sum_tensors"]

_BUCKET_BYTES = 25 * 1024 * 1024


class Sync:
    """Local training: no collectives, no wrapper flags."""

    kind = "local"  # the wrapper's name in a checkpoint (compared with a saved state's only)
    divisor: float = 1.0
    group: Any = None
    sharded = False  # gradients are shards: the norm needs a sum over ranks
    equal_micro_batches = False  # every rank must run the window's global maximum
    reduce_at_step = False  # the library all-reduces gradients at step() (ddp_sync="step")
    # The wrapper reduces gradients inside a backward (DDP's last micro-batch, every FSDP2
    # backward): every rank must be in that backward together.
    syncs_in_backward = False
    # The backward synchronizes only after the wrapper's own forward (DDP prepares its reducer
    # there): a forward through the inner module (``model.module(...)``) skips the sync.
    needs_wrapper_forward = False
    norm_copies = 1.0  # ranks of the counting group that hold the same gradient shard
    # Context parallelism beside the wrapper: ranks holding other pieces of the same rows,
    # whose gradients fullbatch sums at step() (None: the wrapper's group already does).
    context_group: Any = None
    # A composed mesh: tensor-parallel (model) dims beside the data dims (None: none). Set by
    # ``attach_mesh``; the window's one reduction then runs over ``step_group``.
    mesh: MeshFacts | None = None

    def __init__(self, model: nn.Module) -> None:
        # Any: the wrapper's own attributes (DDP's flags, FSDP2's setters) are not part of
        # nn.Module's static interface.
        self.model: Any = model
        self._last_work: Any = None
        self._step_group: Any = None

    def attach_mesh(self, facts: MeshFacts, group: Any) -> None:
        """Count over the data ranks, reduce the window's numbers over ``group`` (data x
        model ranks): the gradients are pieces, so their norm is a sum over ranks."""
        self.mesh = facts
        self._step_group = group
        self.sharded = True

    @property
    def step_group(self) -> Any:
        """The group of the window's one reduction (the counting group without model dims)."""
        return self._step_group if self._step_group is not None else self.group

    @property
    def counts_here(self) -> bool:
        """Whether this rank's counts and loss sums enter the reduction (model ranks other
        than the first hold the same items)."""
        return self.mesh is None or self.mesh.counts_here

    def norm_share(self, grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        """This rank's share of the squared gradient norm summed over ``step_group``."""
        if self.mesh is not None:
            return self.mesh.norm_share(grads, device)
        return squared_norm(grads, device) / self.norm_copies

    def _wait(self, work: Any) -> None:
        """Wait for a collective and keep its handle until the next one.

        Since torch 2.10 a C++ owner that drops a tensor with a Python object takes the GIL.
        If gloo's worker thread held the last reference to a finished collective, it would
        take the GIL to free its tensors; when that happens while the interpreter is shutting
        down, the thread is killed inside a noexcept destructor and the process aborts
        ("terminate called without an active exception", pytorch#190489). Holding the
        handle here makes this thread, which has the GIL, the one that frees it.
        """
        work.wait()
        self._last_work = work

    @property
    def world(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return 0 if self.group is None else dist.get_rank(self.group)

    @property
    def device(self) -> torch.device:
        """Where collective tensors must live (NCCL needs CUDA)."""
        group = self.step_group
        if group is not None and dist.get_backend(group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    @property
    def inner(self) -> nn.Module:
        """The module that runs the user's layers (the wrapper's ``.module`` for DDP)."""
        return self.model

    @contextlib.contextmanager
    def no_collectives(self) -> Iterator[None]:
        """Forward and backward on this rank alone: no gradient sync, no buffer broadcast.

        Raises:
            ValueError: a sharded wrapper (FSDP2), whose every forward all-gathers.
        """
        if self.sharded:
            raise ValueError("a sharded model cannot run a forward without collectives.")
        yield

    def padding(self, real: list[int]) -> list[int]:
        """The padding micro-batches each rank runs, from every rank's real micro-batches.

        >>> Sync(nn.Linear(1, 1)).padding([2, 0])
        [0, 0]
        """
        if self.equal_micro_batches:
            return [max(real) - n for n in real]
        if self.syncs_in_backward:
            return [int(n == 0) for n in real]  # the backward's reduction needs every rank
        return [0 for _ in real]

    def held_grads(self) -> str | None:
        """What the wrapper holds outside ``param.grad`` between a window's micro-batches,
        beyond a checkpoint's reach, with the fix (None: nothing)."""
        return None

    def begin(self, final: bool) -> None:
        """Set the wrapper's sync state for the micro-batch about to be yielded."""

    def end(self) -> None:
        """Restore the wrapper's own sync state."""

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` where the backend needs it; a host tensor goes to an accelerator
        without the host waiting for the device queue (a blocking copy would)."""
        return tensor.to(self.device, non_blocking=self.device.type != "cpu")

    def all_reduce_sum(self, tensor: torch.Tensor, *, step: bool = False) -> torch.Tensor:
        """``tensor`` summed over the counting group (``step=True``: over ``step_group``)."""
        group = self.step_group if step else self.group
        if group is None:
            return tensor
        moved = self._to_device(tensor)
        self._wait(dist.all_reduce(moved, op=dist.ReduceOp.SUM, group=group, async_op=True))
        return moved.to(tensor.device)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """``[world, *tensor.shape]``: every rank's tensor, in rank order."""
        if self.group is None:
            return tensor.unsqueeze(0)
        moved = self._to_device(tensor)
        out = torch.empty(self.world * moved.numel(), dtype=moved.dtype, device=moved.device)
        # all_gather_single is the newer name of all_gather_into_tensor (torch >= 2.10).
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._wait(gather(out, moved.reshape(-1), group=self.group, async_op=True))
        return out.view(self.world, *moved.shape).to(tensor.device)

    def reduce_gradients(self, params: list[nn.Parameter]) -> None:
        """Bucketed all-reduce (sum) of gradients at the step, for ``ddp_sync="step"``."""

    def combine_context_parallel(
        self, params: list[nn.Parameter], buffers: list[torch.Tensor] | None
    ) -> None:
        """Sum gradients over the context-parallel ranks beside the wrapper (in place).

        ``buffers``: the ``accumulate_dtype`` buffers standing in for ``.grad``, else None.
        A parameter without a gradient here may have one on another CP rank: it sums zeros
        (as ``ddp_sync="step"`` does), so every rank's buckets match.
        """
        if self.context_group is None:
            return
        if buffers is None:
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            buffers = [p.grad for p in params if p.grad is not None]
        self._last_work = sum_tensors(buffers, self.context_group)

    def reduce_tensors(self, tensors: list[torch.Tensor]) -> None:
        """Bucketed all-reduce (sum) of tensors, in place (``accumulate_dtype`` buffers)."""

    def finish_window(self) -> None:
        """The window was stepped or discarded."""

    def single_backward(self, final: bool) -> bool:
        """Whether this micro-batch allows only one backward (DDP reduces in the first)."""
        return False

    def forward_collective_modules(self) -> list[nn.Module]:
        """Modules whose forward may start with a collective (``"auto"`` agrees before it)."""
        return []

    def forward_collective(self) -> bool:
        """Whether the coming forward of those modules starts with a collective."""
        return True

    def drop_unreduced_grads(self) -> None:
        """Forget gradients the wrapper holds outside ``param.grad`` (an abandoned attempt)."""


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a sharded gradient), or the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def sum_tensors(tensors: list[torch.Tensor], group: Any) -> Any:
    """Sum ``tensors`` over ``group`` in place, in buckets of 25 MiB; the last work handle.

    DTensor gradients are summed shard by shard (ranks of ``group`` hold the same layout).
    """
    bucket: list[torch.Tensor] = []
    size = 0
    work = None
    for t in [_local(t) for t in tensors]:
        bucket.append(t)
        size += t.numel() * t.element_size()
        if size >= _BUCKET_BYTES:
            work = _sum_bucket(bucket, group)
            bucket, size = [], 0
    if bucket:
        work = _sum_bucket(bucket, group)
    return work


def _sum_bucket(tensors: list[torch.Tensor], group: Any) -> Any:
    flat = torch.cat([t.reshape(-1) for t in tensors])
    work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True)
    work.wait()
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    return work


def all_reduce_over(tensor: torch.Tensor, group: Any = None) -> int:
    """Sum ``tensor`` in place over ``group`` (the default group for ``None``); its size.

    For integrations whose framework owns the group (Lightning's DDP strategy).
    """
    dist.all_reduce(tensor, group=group)
    return dist.get_world_size(group)


def sum_over_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` summed in place over the default group when one is initialized; returned.

    For a framework that sets the group up itself (DeepSpeed); one process may have none.
    """
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor)
    return tensor


def gather_over_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """``[world, *tensor.shape]``: every rank's ``tensor`` over the default group, in rank
    order (``[1, ...]`` without one). For a framework that sets the group up itself."""
    if not (dist.is_available() and dist.is_initialized()):
        return tensor.unsqueeze(0)
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(out, tensor.contiguous())
    return torch.stack(out)

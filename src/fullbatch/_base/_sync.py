"""Everything that talks to ``torch.distributed``: the only module that imports it.

A :class:`Sync` answers three questions for the engine: which ranks count together (the
group), what the wrapper divides gradients by (``W``), and how to set the wrapper's sync state
for one micro-batch. It also runs the window's tiny collectives. Three kinds exist:

- local: a plain model (W = 1, counts local; one warning under an initialized process group);
- DDP: ``require_backward_grad_sync`` is set per micro-batch (what ``no_sync()`` sets, without
  holding a context open across a ``yield``), or kept off and reduced at the step
  (``ddp_sync="step"``);
- FSDP2: ``set_requires_gradient_sync`` per micro-batch (``fsdp_sync="window"``) or on for
  every micro-batch (``"micro_batch"``); ranks run the same number of micro-batches.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from fullbatch._base._versions import check_fsdp2_device
from fullbatch._base._warn import warn

__all__ = ["Sync", "all_reduce_over", "make_sync"]

DDP_SYNC_MODES = ("last", "step")
FSDP_SYNC_MODES = ("window", "micro_batch")


class Sync:
    """Local training: no collectives, no wrapper flags."""

    kind = "local"
    divisor: float = 1.0
    group: Any = None
    sharded = False  # gradients are shards: the norm needs a sum over ranks
    equal_micro_batches = False  # every rank must run the window's global maximum
    reduce_at_step = False  # the library all-reduces gradients at step() (ddp_sync="step")

    def __init__(self, model: nn.Module) -> None:
        # Any: the wrapper's own attributes (DDP's flags, FSDP2's setters) are not part of
        # nn.Module's static interface.
        self.model: Any = model
        self._last_work: Any = None

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
        if self.group is not None and dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def begin(self, final: bool) -> None:
        """Set the wrapper's sync state for the micro-batch about to be yielded."""

    def end(self) -> None:
        """Restore the wrapper's own sync state."""

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return tensor
        moved = tensor.to(self.device)
        self._wait(dist.all_reduce(moved, op=dist.ReduceOp.SUM, group=self.group, async_op=True))
        return moved.to(tensor.device)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """``[world, *tensor.shape]``: every rank's tensor, in rank order."""
        if self.group is None:
            return tensor.unsqueeze(0)
        moved = tensor.to(self.device)
        out = torch.empty(self.world * moved.numel(), dtype=moved.dtype, device=moved.device)
        # all_gather_single is the newer name of all_gather_into_tensor (torch >= 2.10).
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._wait(gather(out, moved.reshape(-1), group=self.group, async_op=True))
        return out.view(self.world, *moved.shape).to(tensor.device)

    def reduce_gradients(self, params: list[nn.Parameter]) -> None:
        """Bucketed all-reduce (sum) of gradients at the step, for ``ddp_sync="step"``."""

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


class _DDPSync(Sync):
    kind = "ddp"

    def __init__(self, model: nn.Module, mode: str, divisor: float | None) -> None:
        super().__init__(model)
        self.group = model.process_group
        self.mode = mode
        self.reduce_at_step = mode == "step"
        # DDP averages over its group; summing ourselves at the step divides by nothing.
        self.divisor = 1.0 if self.reduce_at_step else float(divisor or self.world)
        # static_graph=True records the graph in DDP's first synced iteration and breaks when
        # that iteration runs under no_sync (pytorch#143580): the first window syncs every
        # micro-batch (still exact: the average is linear), so ranks run equally many.
        self.static_graph = bool(getattr(model, "static_graph", False))
        self._first_window = True
        self._saved: bool | None = None

    @property
    def equal_micro_batches(self) -> bool:  # type: ignore[override]
        return self.static_graph and self._first_window and not self.reduce_at_step

    def begin(self, final: bool) -> None:
        if self._saved is None:
            self._saved = self.model.require_backward_grad_sync
        # DDP decides at forward time whether the coming backward reduces: set it before.
        sync = final or self.equal_micro_batches
        self.model.require_backward_grad_sync = sync and not self.reduce_at_step

    def finish_window(self) -> None:
        self._first_window = False

    def single_backward(self, final: bool) -> bool:
        return (final or self.equal_micro_batches) and not self.reduce_at_step

    def end(self) -> None:
        if self._saved is not None:
            self.model.require_backward_grad_sync = self._saved
            self._saved = None

    def forward_collective_modules(self) -> list[nn.Module]:
        # With broadcast_buffers, DDP broadcasts rank 0's buffers at the start of a forward
        # that follows a synchronized one: under "auto" (never synchronized), the first.
        return [self.model] if self.forward_collective() else []

    def forward_collective(self) -> bool:
        return bool(self.model.will_sync_module_buffers())

    def reduce_gradients(self, params: list[nn.Parameter]) -> None:
        for p in params:
            if p.grad is None:  # unused here, maybe used on another rank: reduce zeros
                p.grad = torch.zeros_like(p)
        self.reduce_tensors([p.grad for p in params if p.grad is not None])

    def reduce_tensors(self, tensors: list[torch.Tensor]) -> None:
        bucket_bytes = 25 * 1024 * 1024
        bucket: list[torch.Tensor] = []
        size = 0
        for t in tensors:
            bucket.append(t)
            size += t.numel() * t.element_size()
            if size >= bucket_bytes:
                self._reduce_bucket(bucket)
                bucket, size = [], 0
        if bucket:
            self._reduce_bucket(bucket)

    def _reduce_bucket(self, grads: list[torch.Tensor]) -> None:
        flat = torch.cat([g.reshape(-1) for g in grads])
        self._wait(dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True))
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


class _FSDPSync(Sync):
    kind = "fsdp2"
    sharded = True
    equal_micro_batches = True

    def __init__(self, model: nn.Module, mode: str, divisor: float | None) -> None:
        super().__init__(model)
        mesh = next((p.device_mesh for p in model.parameters() if hasattr(p, "device_mesh")), None)
        if mesh is None:
            raise ValueError("the FSDP2 model has no DTensor parameters: call fully_shard first.")
        if mesh.ndim != 1:
            raise ValueError(
                f"fullbatch supports FSDP2 over a 1-D device mesh; got a {mesh.ndim}-D mesh "
                f"{mesh}. Shard over one data-parallel dimension."
            )
        self.group = mesh.get_group()
        self.mode = mode
        self.divisor = float(divisor or self.world)

    def begin(self, final: bool) -> None:
        sync = final or self.mode == "micro_batch"
        self.model.set_requires_gradient_sync(sync)
        self.model.set_is_last_backward(final)

    def end(self) -> None:
        self.model.set_requires_gradient_sync(True)
        self.model.set_is_last_backward(True)

    def forward_collective_modules(self) -> list[nn.Module]:
        # Every FSDP2 module all-gathers its parameters before its forward.
        modules: list[Any] = self.model.modules()
        return [m for m in modules if isinstance(m, FSDPModule) and isinstance(m, nn.Module)]

    def drop_unreduced_grads(self) -> None:
        # Without gradient sync, FSDP2 accumulates unsharded gradients on its own FSDPParam
        # objects (private in torch 2.6-2.13); zero_grad() does not reach them.
        modules: list[Any] = self.forward_collective_modules()
        for module in modules:
            group = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)
            for fsdp_param in getattr(group, "fsdp_params", []):
                fsdp_param.unsharded_accumulated_grad = None
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded is not None:
                    unsharded.grad = None


def _check_mode(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of {allowed}.")


def make_sync(
    model: nn.Module,
    *,
    process_group: Any = None,
    ddp_sync: str = "last",
    fsdp_sync: str = "window",
    grad_divisor: float | None = None,
) -> Sync:
    """Inspect ``model`` and return the matching :class:`Sync`.

    Raises:
        ValueError: an unknown mode, or a ``process_group`` that is not the wrapper's group.
    """
    _check_mode("ddp_sync", ddp_sync, DDP_SYNC_MODES)
    _check_mode("fsdp_sync", fsdp_sync, FSDP_SYNC_MODES)
    if grad_divisor is not None and not grad_divisor > 0:
        raise ValueError(f"grad_divisor must be > 0, got {grad_divisor!r}.")
    sync: Sync
    if isinstance(model, DistributedDataParallel):
        sync = _DDPSync(model, ddp_sync, grad_divisor)
    elif isinstance(model, FSDPModule):
        check_fsdp2_device(model)  # FSDP2 on CPU needs torch >= 2.7
        sync = _FSDPSync(model, fsdp_sync, grad_divisor)
    else:
        sync = Sync(model)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            warn(
                "a process group is initialized but the model is neither DDP-wrapped nor "
                "fully_shard'ed: fullbatch counts items on this rank only (W = 1). Wrap the "
                "model so that counts and gradients are combined over ranks."
            )
        if process_group is not None:
            raise ValueError(
                "process_group was given for a model that is not DDP-wrapped or "
                "fully_shard'ed; the group is taken from the wrapper. Wrap the model, or drop "
                "process_group."
            )
        return sync
    if process_group is not None and process_group != sync.group:
        ranks = dist.get_process_group_ranks(sync.group)
        raise ValueError(
            f"process_group={process_group!r} is not the wrapper's data-parallel group "
            f"(ranks {ranks}). fullbatch counts items over the group the wrapper reduces "
            "gradients over; drop process_group= or wrap the model with that group."
        )
    return sync


def all_reduce_over(tensor: torch.Tensor, group: Any = None) -> int:
    """Sum ``tensor`` in place over ``group`` (the default group for ``None``); its size.

    For integrations whose framework owns the group (Lightning's DDP strategy).
    """
    dist.all_reduce(tensor, group=group)
    return dist.get_world_size(group)

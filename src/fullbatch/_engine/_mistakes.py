"""Migration mistakes that train silently wrong, caught before anything changes (issues 18, 26).

Each check looks for a signature that correct code cannot have:

- **scheduler stepped per micro-batch** (no ``scheduler=``): the learning rate changes
  *between two backward calls of one window*. Setting the LR for the coming step before the
  first backward or after the last one is fine; a change in between means
  ``scheduler.step()`` runs once per micro-batch, decaying K times too fast.
- **labels and counts** (:mod:`fullbatch._engine._labels`): labels shifted twice, padding
  counted (with an ``attention_mask``, or without one from the model's pad id), a count
  without the causal shift. On the first backward calls of the first window (a mistake in the
  data pipeline shows in every micro-batch): one host sync per Accumulator.
- **a loss already scaled by a GradScaler** (:mod:`fullbatch._engine._scaled`):
  ``window.backward(scaler.scale(loss_sum), n)``, the scaler not given (nothing unscales: the
  scale times too large) or given (scaled twice).
- **the same loss backpropagated twice**: the same autograd graph (the loss tensor, or a view
  of it) passed to ``window.backward`` a second time for one micro-batch, e.g. again with
  ``count=0``: its gradient would count twice. A second *term* is another graph and passes.
- **DDP forward through ``ddp.module``** (:mod:`fullbatch._engine._route`, first window).
- **share without totals**: ``window.backward(share)`` in a window that never read
  ``window.totals``, so the share cannot have been divided by it (warned).
- **uncollated micro-batch**: with ``micro_batches=K`` a loader item that is a list of per-row
  dicts or tuples is handed to the loop as it is (warned once).
- **loader and window size that disagree**: with ``micro_batches=K`` a sized loader of fewer
  than K items (one partial window: whole batches given as micro-batches?); with
  ``micro_batch_size=M`` a ``DataLoader(batch_size=B)`` with ``B <= M``, or loader items of
  exactly M rows, one micro-batch per window (a loader of micro-batches: nothing accumulates).
  Warned once.
- **optimizer on some parameters**: model parameters that require grad but that the optimizer
  does not hold never train (warned at construction).

Not checked here, because a loss value has no unit: a mean-reduced loss passed with its count
(``F.cross_entropy(..., reduction="mean")``, n), a count in another unit than the loss's sum,
a share divided by the micro-batch's own count. ``fb.verify`` catches the first and the last.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sized
from typing import Any

import torch
from torch import nn

from fullbatch._base._split import _is_row_list, count_rows
from fullbatch._base._sync import Sync
from fullbatch._base._warn import warn
from fullbatch._engine._labels import label_mistake, pad_token_ids
from fullbatch._engine._route import ForwardRoute
from fullbatch._engine._scaled import ScaledLossCheck

__all__ = ["MistakeChecks", "warn_untrained"]


def warn_untrained(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Warn when some of the model's trainable parameters are not in the optimizer.

    >>> import warnings
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     warn_untrained(model, torch.optim.SGD(model[1].parameters(), lr=0.1))
    >>> print(str(caught[0].message).split(":")[0])
    2 of the model's 4 trainable parameters (0.weight, 0.bias) are not in the optimizer
    """
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    left = [n for n, p in named if id(p) not in stepped]
    if not left or len(left) == len(named):  # none, or all: the latter raises elsewhere
        return
    shown = ", ".join(left[:3]) + (", ..." if len(left) > 3 else "")
    warn(
        f"{len(left)} of the model's {len(named)} trainable parameters ({shown}) are not in "
        "the optimizer: they get gradients but never train. Freeze them "
        "(`p.requires_grad_(False)`) if that is the intent, or build the optimizer from "
        "model.parameters()."
    )


#: backward calls (of the first window) whose labels and count are checked
_LABEL_CHECKS = 2
#: windows whose split is compared with micro_batch_size (a loader of micro-batches)
_SIZE_CHECKS = 2
#: autograd nodes that only view their input: a view of a loss is the same loss
_VIEWS = frozenset(
    {"ViewBackward0", "ReshapeAliasBackward0", "AliasBackward0", "SqueezeBackward0",
     "SqueezeBackward1", "SqueezeBackward2", "UnsqueezeBackward0", "ExpandBackward0"}
)  # fmt: skip


def _graph(loss: torch.Tensor) -> Any:
    """The autograd node that makes ``loss``, looking through views (None for a leaf)."""
    node = loss.grad_fn
    while node is not None and type(node).__name__ in _VIEWS and node.next_functions:
        node = node.next_functions[0][0]
    return node


def loader_mistakes(
    loader: Any, *, micro_batches: int | None, micro_batch_size: int | None
) -> dict[str, str]:
    """What the loader's own facts say against the window size: ``{kind: message}``.

    >>> loader_mistakes([1, 2], micro_batches=4, micro_batch_size=None)["items"].split(":")[0]
    'the loader has 2 item(s) but micro_batches=4'
    """
    found = {}
    length = len(loader) if isinstance(loader, Sized) else None
    if micro_batches is not None and length is not None and 0 < length < micro_batches:
        found["items"] = (
            f"the loader has {length} item(s) but micro_batches={micro_batches}: each loader "
            "item is one micro-batch, so the whole loader is a single partial window. If "
            "each loader item is a whole batch (a window), give micro_batch_size=M instead: "
            "fb.Accumulator(..., micro_batch_size=M) splits every item into micro-batches of "
            "M rows."
        )
    size = getattr(loader, "batch_size", None)
    if (
        micro_batch_size is not None
        and isinstance(loader, torch.utils.data.DataLoader)
        and isinstance(size, int)
        and size <= micro_batch_size
    ):
        found["size"] = _no_accumulation(f"the DataLoader's batch_size={size}", micro_batch_size)
    return found


def _no_accumulation(what: str, size: int) -> str:
    return (
        f"{what} is not larger than micro_batch_size={size}: every loader item becomes a "
        "window of one micro-batch, so nothing is accumulated (one optimizer step per loader "
        "item). If the loader yields micro-batches, give micro_batches=K instead (K of them "
        f"make a window): fb.Accumulator(..., micro_batches=K); micro_batch_size={size} "
        "splits each loader item, a whole window, into micro-batches of that many rows."
    )


class MistakeChecks:
    """Per-Accumulator state of the checks: what was seen, what was already warned.

    The window calls :meth:`see` when it yields a micro-batch, :meth:`totals_read` when
    ``window.totals`` is read, and :meth:`before_backward` before each backward; an error
    that method returns is raised by the window after it abandoned itself.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        sync: Sync,
        scheduler: Any = None,
        micro_batch_size: int | None = None,
    ) -> None:
        self._optimizer = optimizer
        self._watch_lr = scheduler is None  # a given scheduler is watched by LoopGuard
        self._label_checks = _LABEL_CHECKS
        self._pad_ids = pad_token_ids(model)
        self._micro: Any = None
        self._lr_window: Any = None  # the window the learning rates were taken in
        self._lrs: list[Any] | None = None
        self._read_in: Any = None  # the last window whose totals were read
        self._graphs: list[Any] = []  # autograd nodes backpropagated for this micro-batch
        self._scaled = ScaledLossCheck()
        self._warned: set[str] = set()
        self._first: Any = None  # a weak reference to the first window (the route hooks' life)
        self._route: ForwardRoute | None = None
        inner = getattr(model, "module", None)
        if sync.needs_wrapper_forward and isinstance(inner, nn.Module):
            self._route = ForwardRoute(model, inner)
        self._size = micro_batch_size
        self._size_checks = _SIZE_CHECKS if micro_batch_size is not None else 0
        self._single = 0  # windows of one micro-batch of exactly micro_batch_size rows
        self._loader_items: int | None = None

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warn(message)

    # -- hooks called by the accumulator and the window ---------------------------------------

    def loader(self, loader: Any, *, micro_batches: int | None, resuming: bool = False) -> None:
        """``acc.windows(loader)`` was called: check the loader against the window size.

        ``resuming``: a state is loaded, so the loader holds what is left of the run (it may
        rightly be shorter than one window); its length says nothing about its items.
        """
        self._loader_items = len(loader) if isinstance(loader, Sized) else None
        found = loader_mistakes(loader, micro_batches=micro_batches, micro_batch_size=self._size)
        if resuming:
            found.pop("items", None)
        for key, message in found.items():
            self._warn_once(key, message)

    def see(self, window: Any, micro: Any) -> None:
        """A micro-batch was yielded: keep it for the label checks, flag an uncollated one."""
        if self._first is None:
            self._first = weakref.ref(window)  # weakly: a window holds its loader item
        elif self._first() is not window and self._route is not None:
            self._route.close()  # the first window is over: its checks are done
            self._route = None
        if self._route is not None:
            self._route.start_micro_batch()
        self._graphs.clear()
        self._micro = micro if self._label_checks > 0 else None
        if _is_row_list(micro):
            self._warn_once(
                "rows",
                f"a micro-batch is a list of {len(micro)} per-row records, handed to your loop "
                "as it is (with micro_batches=K each loader item is one micro-batch). Collate "
                "rows in the loader (a DataLoader with batch_size= and a collate_fn that pads, "
                "e.g. DataCollatorWithPadding), or pass whole windows with micro_batch_size=, "
                "which collates rows of equal length.",
            )
        if self._size_checks > 0 and window._state.yielded == 1:
            self._check_size(window, micro)

    def _check_size(self, window: Any, micro: Any) -> None:
        """A window of one micro-batch of exactly micro_batch_size rows: micro-batches given?"""
        self._size_checks -= 1
        if window.is_padding or len(window) != 1:
            return
        try:
            rows = count_rows(micro)
        except ValueError:
            return
        if rows != self._size:
            return
        self._single += 1
        more = self._loader_items is None or self._loader_items >= 2
        if more and (self._single >= 2 or self._loader_items is not None):
            assert self._size is not None
            self._warn_once("size", _no_accumulation(f"a loader item of {rows} rows", self._size))

    def totals_read(self, window: Any) -> None:
        self._read_in = window

    def before_backward(self, window: Any, loss: torch.Tensor, count: Any) -> Exception | None:
        """Check one backward call before it changes anything: the error to raise, or None.

        ``window`` is the user's Window (its ``index``, ``is_padding`` and state are read).
        """
        scaled = self._scaled(loss, window._engine.step_plan.scaler, window.index)
        if scaled is not None:
            return scaled
        node = _graph(loss)
        if node is not None:
            if any(node is seen for seen in self._graphs):
                return ValueError(
                    "the same loss was passed to window.backward twice for this micro-batch "
                    f"(window {window.index}): its gradient would count twice. Call "
                    "window.backward once per loss term; a second term over the same items "
                    "is another tensor, `window.backward(aux_sum, 0)` (with "
                    "retain_graph=True on the first call when the terms share a graph). "
                    "Nothing was changed."
                )
            self._graphs.append(node)
        state = window._state
        if self._route is not None and state.current_backwards == 0:
            message = self._route.message(state.yielded - 1)
            if message is not None:
                return RuntimeError(message)
        error = self._check_lr(window)
        if error is not None:
            return error
        if count is None:
            if self._read_in is not window:
                self._warn_once(
                    "share",
                    "window.backward(share) in a window that never read window.totals: the "
                    "share must be the loss sum divided by a window.totals entry (e.g. "
                    "`window.backward(loss_sum / window.totals['tokens'])`), or each "
                    "micro-batch weighs its own sum (docs/mistakes.md). Or pass the summed "
                    "loss and its count: window.backward(loss_sum, n).",
                )
        elif self._label_checks > 0 and not window.is_padding:
            self._label_checks -= 1
            micro, self._micro = self._micro, None
            if isinstance(micro, Mapping):
                message = label_mistake(micro, count, self._pad_ids)
                if message is not None:
                    return ValueError(message)
        return None

    def close(self) -> None:
        if self._route is not None:
            self._route.close()
            self._route = None
        self._graphs.clear()

    def _check_lr(self, window: Any) -> Exception | None:
        if not self._watch_lr:
            return None
        lrs = [_lr(group.get("lr", 0.0)) for group in self._optimizer.param_groups]
        if self._lr_window is not window:
            self._lr_window, self._lrs = window, lrs
            return None
        if lrs != self._lrs:
            return RuntimeError(
                f"the learning rate changed between two backward calls of window "
                f"{window.index} (from {self._lrs} to {lrs}): scheduler.step() once per "
                "micro-batch decays the schedule K times too fast. The window was discarded "
                "and nothing was stepped. Pass scheduler= to the Accumulator (it steps once "
                "per optimizer step) and delete your scheduler.step(), or call it after "
                "window.step()."
            )
        return None


def _lr(value: Any) -> Any:
    """A comparable learning rate; a tensor one by identity and version (no host sync)."""
    if isinstance(value, torch.Tensor):
        return (id(value), value._version)
    return float(value)

"""The engine's checks of the user's loop, as one list of watches built once per Accumulator.

Each check is a :class:`~fullbatch._engine._watch.Watch` in a module of its own family; this
module only says which ones an Accumulator needs and in which order they run at each point
(the first to raise names the mistake). A new check is a class implementing ``Watch`` and one
line here. The one-time checks (labels, a loss scaled by a GradScaler, the DDP route, the
loader's items, packing) drop out of the list once they ran: a steady-state micro-batch meets
only the loop guard's sentinel, the same-loss check and, without ``scheduler=``, the
learning-rate check
(``python benchmarks/watch_cost.py`` measures each).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fullbatch._base._sync import Sync
from fullbatch._engine._guards import LoopGuard
from fullbatch._engine._labels import LabelCheck
from fullbatch._engine._loader_checks import LoaderChecks
from fullbatch._engine._mistakes import LearningRateWatch, SameLossTwice, ShareWithoutTotals
from fullbatch._engine._route import ForwardRoute
from fullbatch._engine._scaled import ScaledLossWatch
from fullbatch._engine._verify_pack import FirstWindowCheck
from fullbatch._engine._watch import Watch, Watches

__all__ = ["engine_watches"]


def engine_watches(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    sync: Sync,
    guard: LoopGuard,
    loader: LoaderChecks,
    pack: FirstWindowCheck | None,
    scheduler_given: bool,
    shares: bool,
    scaler: Any = None,
) -> Watches:
    """The Accumulator's watches, in the order they run.

    ``guard`` (the sentinel gradient: a cleared gradient explains every later surprise),
    ``pack`` (``pack=True``'s first-window check) and ``loader`` are also kept by the engine
    and the Accumulator for their other jobs; ``shares``: ``counts=`` was given, so
    ``window.backward(share)`` is possible; ``scaler``: the enabled GradScaler given, or None
    (a loss already multiplied by a scale is refused either way).

    >>> model = torch.nn.Linear(2, 2)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> guard = LoopGuard(opt, None, list(model.parameters()))
    >>> watches = engine_watches(
    ...     model, opt, sync=Sync(model), guard=guard, loader=LoaderChecks(micro_batch_size=None),
    ...     pack=None, scheduler_given=False, shares=False)
    >>> print(*(type(w).__name__ for w in watches), sep=", ")
    LoopGuard, SameLossTwice, ScaledLossWatch, LearningRateWatch, LabelCheck, LoaderChecks
    >>> watches.close()
    """
    found: list[Watch | None] = [
        guard,
        pack,
        ForwardRoute.watching(model, sync),
        SameLossTwice(),
        ScaledLossWatch(scaler),
        None if scheduler_given else LearningRateWatch(optimizer),
        ShareWithoutTotals() if shares else None,
        LabelCheck(model),
        loader,
    ]
    return Watches(w for w in found if w is not None)

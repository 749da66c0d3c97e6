"""Keep an LR schedule where it was across a step that a framework takes anyway.

fullbatch never steps the scheduler for a skipped window (no counted items, non-finite
loss). Inside Lightning and the Hugging Face Trainer the framework steps it regardless; the
integrations take a :class:`KeptSchedule` when they skip and restore it after that step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["KeptSchedule"]


class KeptSchedule:
    """The state of some schedulers and of the optimizer's hyperparameters, to put back.

    Schedulers write the learning rate (and e.g. momentum) into the param groups, so both
    are kept: loading a scheduler's state alone would leave the groups at the stepped values.

    >>> import torch
    >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    >>> sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    >>> kept = KeptSchedule([sched], opt.param_groups)
    >>> opt.step(); sched.step()
    >>> kept.restore()
    >>> sched.last_epoch, opt.param_groups[0]["lr"]
    (0, 1.0)
    """

    def __init__(self, schedulers: Iterable[Any], param_groups: Iterable[dict[str, Any]]) -> None:
        self._schedulers = [(s, s.state_dict()) for s in schedulers if s is not None]
        self._groups = [(g, {k: v for k, v in g.items() if k != "params"}) for g in param_groups]

    def restore(self) -> None:
        for scheduler, state in self._schedulers:
            scheduler.load_state_dict(state)
        for group, values in self._groups:
            group.update(values)

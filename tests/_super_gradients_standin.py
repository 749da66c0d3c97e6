"""A stand-in for the parts of Super-Gradients 3.7.1 that ``fullbatch.super_gradients`` uses.

CI cannot install Super-Gradients (its pins do not resolve with pip), so the tests import
``fullbatch.super_gradients`` against these modules, put in ``sys.modules`` under SG's names.
Each piece follows ``super_gradients/training/sg_trainer/sg_trainer.py`` and
``super_gradients/training/utils/callbacks/base_callbacks.py`` of 3.7.1:

- ``Trainer.train``: ``training_params["phase_callbacks"]`` first in the callback list (SG
  appends its own after them), the criterion is ``training_params["loss"]`` itself,
  ``scaler = GradScaler(enabled=mixed_precision)``, ``on_training_start`` with a
  ``PhaseContext`` holding ``net``, ``optimizer`` and ``criterion``; per epoch
  ``on_train_loader_start``, ``_train_epoch``, ``on_train_loader_end``, then validation under
  ``torch.no_grad()`` with the model in eval mode, which calls the criterion through
  ``_get_losses``; ``on_training_end`` in a ``finally``;
- ``_train_epoch``: ``net.train()``, at most ``len(train_loader)`` (or ``max_train_batches``)
  batches; per batch ``on_train_batch_start``, forward, ``_get_losses`` (a tuple criterion
  output is ``(loss, logging_items)``), ``on_train_batch_loss_end``,
  ``_backward_step(loss, context.epoch, batch_idx, context)``, ``on_train_batch_end``;
- ``_backward_step`` (stock): backward of the scaled loss, ``on_train_batch_backward_end``;
  when ``(batch_idx + 1 + len(train_loader) * epoch) % batch_accumulate == 0``:
  ``on_train_batch_gradient_step_start``, unscale and ``clip_grad_norm_`` when
  ``clip_grad_norm`` is set, ``scaler.step``, ``scaler.update``, ``zero_grad``,
  ``on_train_batch_gradient_step_end``.

Where it differs: the optimizer is always ``torch.optim.SGD(lr=initial_lr,
**optimizer_params)`` (SG builds it from the name); no EMA, loggers or checkpoints; the scaler
is ``torch.amp.GradScaler("cpu")`` (SG enables its scaler on CUDA only), so the tests can
reach the GradScaler path on CPU.
"""

from __future__ import annotations

import itertools
import types
from types import SimpleNamespace
from typing import Any

import torch

DEFAULTS = {
    "batch_accumulate": 1,
    "phase_callbacks": None,
    "clip_grad_norm": None,
    "max_train_batches": None,
    "mixed_precision": False,
    "ema": False,
    "optimizer_params": {},
}
PHASES = (
    "on_training_start",
    "on_train_loader_start",
    "on_train_batch_start",
    "on_train_batch_loss_end",
    "on_train_batch_backward_end",
    "on_train_batch_gradient_step_start",
    "on_train_batch_gradient_step_end",
    "on_train_batch_end",
    "on_train_loader_end",
    "on_validation_batch_end",
    "on_training_end",
)


class PhaseContext:
    def __init__(self, **kwargs: Any) -> None:
        self.update_context(**kwargs)

    def update_context(self, **kwargs: Any) -> None:
        for name, value in kwargs.items():
            setattr(self, name, value)


class Callback:
    """Every phase a no-op, as SG's base class."""


for _phase in PHASES:
    setattr(Callback, _phase, lambda self, context: None)


class CallbackHandler:
    def __init__(self, callbacks: list[Any]) -> None:
        self.callbacks = callbacks

    def __getattr__(self, phase: str) -> Any:
        if phase not in PHASES:
            raise AttributeError(phase)
        return lambda context: [getattr(c, phase)(context) for c in self.callbacks]


class Trainer:
    def __init__(self, experiment_name: str, ckpt_root_dir: Any = None, **kwargs: Any) -> None:
        self.experiment_name = experiment_name
        self.max_train_batches = None
        self.ema = False

    def train(
        self,
        model: torch.nn.Module,
        training_params: dict[str, Any] | None = None,
        train_loader: Any = None,
        valid_loader: Any = None,
        **kwargs: Any,
    ) -> None:
        p = {**DEFAULTS, **(training_params or {})}
        if p["ema"]:
            raise NotImplementedError("the stand-in has no EMA")
        self.training_params = SimpleNamespace(**p)
        self.net, self.train_loader, self.valid_loader = model, train_loader, valid_loader
        self.criterion = p["loss"]
        self.max_epochs, self.batch_accumulate = p["max_epochs"], p["batch_accumulate"]
        self.max_train_batches = p["max_train_batches"]
        self.optimizer = torch.optim.SGD(
            model.parameters(), lr=p["initial_lr"], **p["optimizer_params"]
        )
        self.phase_callbacks = list(p["phase_callbacks"] or [])
        self.phase_callback_handler = CallbackHandler(self.phase_callbacks)
        self.scaler = torch.amp.GradScaler("cpu", enabled=p["mixed_precision"])
        context = PhaseContext(optimizer=self.optimizer, net=self.net, criterion=self.criterion)
        handler = self.phase_callback_handler
        handler.on_training_start(context)
        try:
            for epoch in range(self.max_epochs):
                context.update_context(epoch=epoch)
                handler.on_train_loader_start(context)
                self._train_epoch(context)
                handler.on_train_loader_end(context)
                self._validate_epoch(context)
        finally:
            handler.on_training_end(context)

    def _get_losses(self, outputs: Any, targets: Any) -> tuple[torch.Tensor, Any]:
        loss = self.criterion(outputs, targets)
        if isinstance(loss, tuple):
            return loss
        return loss, loss.unsqueeze(0).detach()

    def _train_epoch(self, context: PhaseContext) -> None:
        self.net.train()
        expected = (
            len(self.train_loader) if self.max_train_batches is None else self.max_train_batches
        )
        handler = self.phase_callback_handler
        for batch_idx, (inputs, targets) in enumerate(self.train_loader):
            if expected <= batch_idx:
                break
            context.update_context(batch_idx=batch_idx, inputs=inputs, target=targets)
            handler.on_train_batch_start(context)
            outputs = self.net(inputs)
            loss, items = self._get_losses(outputs, targets)
            context.update_context(preds=outputs, loss_log_items=items)
            handler.on_train_batch_loss_end(context)
            self._backward_step(loss, context.epoch, batch_idx, context)
            handler.on_train_batch_end(context)

    def _backward_step(self, loss: torch.Tensor, epoch: int, batch_idx: int, context: Any) -> None:
        self.scaler.scale(loss).backward()
        self.phase_callback_handler.on_train_batch_backward_end(context)
        global_step = batch_idx + 1 + len(self.train_loader) * epoch
        if global_step % self.batch_accumulate == 0:
            self.phase_callback_handler.on_train_batch_gradient_step_start(context)
            if self.training_params.clip_grad_norm:
                self.scaler.unscale_(self.optimizer)
                torch.nn.utils.clip_grad_norm_(
                    self.net.parameters(), self.training_params.clip_grad_norm
                )
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad()
            self.phase_callback_handler.on_train_batch_gradient_step_end(context)

    def _validate_epoch(self, context: PhaseContext) -> None:
        self.net.eval()
        with torch.no_grad():
            for inputs, targets in self.valid_loader:
                items = self._get_losses(self.net(inputs), targets)[1]
                context.update_context(loss_log_items=items)
                self.phase_callback_handler.on_validation_batch_end(context)


def modules() -> dict[str, types.ModuleType]:
    """The stand-in's modules under Super-Gradients' names, for ``sys.modules``."""
    names = (
        "super_gradients",
        "super_gradients.training",
        "super_gradients.training.utils",
        "super_gradients.training.utils.callbacks",
    )
    # Where SG 3.7.1 defines them (the probe recognises SG's Trainer by its class's package).
    Trainer.__module__ = "super_gradients.training.sg_trainer.sg_trainer"
    Callback.__module__ = PhaseContext.__module__ = (
        "super_gradients.training.utils.callbacks.base_callbacks"
    )
    out = {name: types.ModuleType(name) for name in names}
    out["super_gradients"].__version__ = "3.7.1 (stand-in)"  # type: ignore[attr-defined]
    out["super_gradients.training"].Trainer = Trainer  # type: ignore[attr-defined]
    callbacks = out["super_gradients.training.utils.callbacks"]
    callbacks.Callback = Callback  # type: ignore[attr-defined]
    callbacks.PhaseContext = PhaseContext  # type: ignore[attr-defined]
    for parent, child in itertools.pairwise(names):
        setattr(out[parent], child.rsplit(".", 1)[1], out[child])
    return out

"""Who stepped the optimizer: fullbatch's own routes by what they declare, others by package.

**How a fullbatch route says what it is.** Its class sets ``fullbatch_route``, the public name
users know it by (``"fullbatch.hf.ExactTrainer"``, ``"fb.Accumulator"``); the probe reads the
attribute from the nearest class that declares it, so a user's subclass is still recognised.
A route that clips inside its own multiply (``fb.Accumulator(max_grad_norm=...)``: no
``clip_grad_norm_`` call to observe) also offers ``fullbatch_clip()``: ``(max_norm, norm before
the clip, coefficient)`` of the step being taken, or None; the engine publishes the verdict it
is applying, the probe reads nothing else of it. A callback (Lightning's ``ExactAccumulation``)
declares it the same way; the probe finds it among its Trainer's callbacks.

**Other engines** cannot declare anything: they are recognised by the package their classes
come from (``transformers``, ``trl``, ``lightning``, ``composer``, ``super_gradients``,
``accelerate``, ``colossalai``, ``deepspeed``), looking at the ``self`` of the frames above
``step()``. Nothing is read from any frame but ``self``, and nothing is written.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

__all__ = ["Engine", "declared_route", "find_engine"]

_DEPTH = 64
#: Optimizer wrappers that step the torch optimizer inside them, by package: named the engine
#: only when no engine is found above them (``fb.Accumulator`` steps through them too).
_WRAPPER_PACKAGES = {
    "accelerate": "Accelerate",
    "colossalai": "ColossalAI",
    "deepspeed": "DeepSpeed",
}
_TRAINER_PACKAGES = {"composer": "Composer", "super_gradients": "Super-Gradients"}


@dataclass(frozen=True)
class Engine:
    """Who stepped the optimizer.

    Attributes:
        name: a short name (``"transformers.Trainer"``, ``"a hand-written loop"``).
        fullbatch: one of fullbatch's own routes (its loss is then the user's to declare).
        package: the engine's package (``"trl"``, ``"transformers"``, ``"lightning"``, ...),
            or None for a hand-written loop and fullbatch's routes.
        trainer: the class name of a foreign trainer (``"SFTTrainer"``), or None.
        clip: ``(max_norm, total_norm, coefficient)`` of a clip the engine applied itself, not
            through ``clip_grad_norm_``, as it published it.
        clip_asked: the clip a foreign trainer was configured with, ``(max_norm, where)``
            (0: no clip; ``"TrainingArguments.max_grad_norm"``, Lightning's
            ``"Trainer(gradient_clip_val=...)"``), or None where no trainer setting says.
        trainer_object: the trainer itself (its class and configuration answer what objective
            it trains: :mod:`fullbatch._probe._trainer_objective`), or None.
    """

    name: str
    fullbatch: bool = False
    package: str | None = None
    trainer: str | None = None
    clip: tuple[float, float, float] | None = None
    clip_asked: tuple[float, str] | None = None
    trainer_object: Any = field(default=None, compare=False, repr=False)


def declared_route(obj: Any) -> str | None:
    """The ``fullbatch_route`` an object's class (or a base) declares, or None.

    >>> class Wing:
    ...     fullbatch_route = "fullbatch.example.Wing"
    >>> class Mine(Wing): ...
    >>> declared_route(Mine()), declared_route(object())
    ('fullbatch.example.Wing', None)
    """
    for cls in type(obj).__mro__:
        route = cls.__dict__.get("fullbatch_route")
        if isinstance(route, str):
            return route
    return None


def _own(obj: Any, route: str) -> Engine:
    """The route's engine; a user's subclass of a route is named beside it."""
    declares = "fullbatch_route" in type(obj).__dict__
    name = route if declares else f"{route} ({type(obj).__name__})"
    clip = getattr(obj, "fullbatch_clip", None)
    published = clip() if callable(clip) else None
    return Engine(name, fullbatch=True, clip=published, trainer_object=obj)


def _packages(obj: Any) -> list[tuple[str, str]]:
    """``(package, class name)`` of every class in ``obj``'s MRO."""
    return [(c.__module__.split(".")[0], c.__name__) for c in type(obj).__mro__]


def _lightning(obj: Any) -> Engine | None:
    try:
        trainer = obj.trainer if hasattr(obj, "trainer") else obj
    except RuntimeError:  # a LightningModule not attached to a Trainer
        return None
    callbacks = getattr(trainer, "callbacks", None)
    if not isinstance(callbacks, list):
        return None
    for callback in callbacks:
        route = declared_route(callback)
        if route is not None:
            return Engine(route, fullbatch=True)
    asked = None
    if getattr(trainer, "gradient_clip_algorithm", "norm") in ("norm", None):
        value = getattr(trainer, "gradient_clip_val", None)
        asked = (float(value or 0.0), f"Trainer(gradient_clip_val={value})")
    return Engine("Lightning", package="lightning", clip_asked=asked, trainer_object=trainer)


def _max_grad_norm(obj: Any) -> tuple[float, str] | None:
    """A Hugging Face trainer's ``args.max_grad_norm`` (0 or None: no clip), or None."""
    value = getattr(getattr(obj, "args", None), "max_grad_norm", "absent")
    if value != "absent" and (value is None or isinstance(value, (int, float))):
        return float(value or 0.0), "TrainingArguments.max_grad_norm"
    return None


def _foreign(obj: Any) -> Engine | None:
    classes = _packages(obj)
    packages = {p for p, _ in classes}
    cls = type(obj).__name__
    trainer = any(name.endswith("Trainer") for _, name in classes)
    if "trl" in packages and trainer:
        return Engine(f"trl.{cls}", package="trl", trainer=cls, clip_asked=_max_grad_norm(obj),
                      trainer_object=obj)  # fmt: skip
    if "transformers" in packages and trainer:
        name = f"transformers.{cls}" if cls == "Trainer" else f"{cls} (transformers)"
        return Engine(name, package="transformers", trainer=cls,
                      clip_asked=_max_grad_norm(obj), trainer_object=obj)  # fmt: skip
    if packages & {"lightning", "pytorch_lightning"}:
        return _lightning(obj)
    for package, name in _TRAINER_PACKAGES.items():
        if package in packages and trainer:
            return Engine(name, package=package, trainer=cls)
    return None


def _here(frame: FrameType) -> bool:
    """A frame of the probe itself (its hooks and checks are not the engine)."""
    return str(frame.f_globals.get("__name__", "")).startswith("fullbatch._probe")


def find_engine() -> Engine:
    """The engine that is stepping the optimizer now, from the ``self`` of the frames above.

    >>> find_engine().name
    'a hand-written loop'
    """
    frame: FrameType | None = sys._getframe(1)
    wrapped = None
    for _ in range(_DEPTH):
        if frame is None:
            break
        obj = None if _here(frame) else frame.f_locals.get("self")
        if obj is not None:
            route = declared_route(obj)
            if route is not None:
                return _own(obj, route)
            found = _foreign(obj)
            if found is not None:
                return found
            if wrapped is None:
                packages = {p for p, _ in _packages(obj)}
                wrapped = next((n for p, n in _WRAPPER_PACKAGES.items() if p in packages), None)
        frame = frame.f_back
    if wrapped is not None:
        return Engine(wrapped, package=wrapped.lower())
    return Engine("a hand-written loop")

"""The ``demo`` extra: transformers, matplotlib and tqdm, checked before any work starts."""

from __future__ import annotations

import importlib

__all__ = ["DEMO_EXTRA", "INSTALL_HINT", "MissingExtraError", "require_demo_extra"]

DEMO_EXTRA = ("transformers", "matplotlib", "tqdm")
INSTALL_HINT = "pip install 'fullbatch[demo]'"


class MissingExtraError(ImportError):
    """A package of the ``demo`` extra cannot be imported; the message is one line."""


def require_demo_extra(modules: tuple[str, ...] = DEMO_EXTRA) -> None:
    """Import each module once, so a missing one fails now and not after minutes of training.

    Raises:
        MissingExtraError: naming the module, why it failed, and the install command.
    """
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else "not importable"
            raise MissingExtraError(
                f"fullbatch demo needs {name} ({reason}); install the demo extra: {INSTALL_HINT}"
            ) from exc

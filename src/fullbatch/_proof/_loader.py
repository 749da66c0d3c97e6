"""``MODULE:FN`` and ``FILE.py:FN`` on a command line: the function they name, or one line why not.

``fullbatch verify --model`` and ``fullbatch probe --objective`` name user code this way. A
``FILE.py`` is loaded as ``python FILE.py`` would see its neighbours (its folder first on
``sys.path``, kept for the rest of the process: the function may import them when called); a
``MODULE`` is imported as ``python -m`` would find it (the current folder first). Every problem
becomes a :class:`LoadError` whose message is one line naming the problem and the fix. No torch
here: the CLI loads this before it knows it needs torch.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import traceback
from pathlib import Path
from typing import Any

__all__ = ["LoadError", "load_function", "one_line"]


class LoadError(Exception):
    """Bad user input on a command line: the message is one line with the fix."""


def one_line(error: BaseException) -> str:
    """``Type: first line of the message``.

    >>> one_line(ValueError("bad\\nmore"))
    'ValueError: bad'
    """
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def _where(error: BaseException) -> str:
    """`` at file:line``: the innermost frame of the user's code that raised ``error``."""
    frames = [  # without importlib's frozen frames and this module's own
        f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith("<")
    ]
    frames = [f for f in frames if f.filename != __file__]
    return f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def _import(spec: str, module_name: str, prefix: str) -> Any:
    if module_name.endswith(".py"):
        file = Path(module_name)
        if not file.is_file():
            raise LoadError(f"{prefix}: no such file {file}; check the path")
        name = f"_fullbatch_user_{file.stem}"
        module_spec = importlib.util.spec_from_file_location(name, file)
        if module_spec is None or module_spec.loader is None:
            raise LoadError(f"{prefix}: {file} is not a Python module")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module  # dataclasses and pickling look modules up here
        folder = str(file.resolve().parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)
        module_spec.loader.exec_module(module)
        return module
    cwd_added = os.getcwd() not in sys.path
    if cwd_added:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(module_name)
    finally:
        if cwd_added:
            sys.path.remove(os.getcwd())


def load_function(spec: str, *, option: str, wanted: str, example: str) -> Any:
    """The callable ``spec`` names: ``module:attr`` (dotted attributes allowed) or
    ``path/file.py:attr``.

    Args:
        spec: what the user passed.
        option: the command-line option, for the message (``"--model"``).
        wanted: what ``attr`` should be, for the message (``"a function that returns a
            model"``).
        example: a spec that would work, for the message.

    Raises:
        LoadError: a malformed spec, a missing file or module, an import that failed (where),
            a missing attribute, or one that is not callable.

    >>> load_function("os.path:join", option="--fn", wanted="a function", example="m:f").__name__
    'join'
    >>> load_function("join", option="--fn", wanted="a function", example="m:f")
    Traceback (most recent call last):
    ...
    fullbatch._proof._loader.LoadError: --fn join: expected MODULE:FN, e.g. m:f
    """
    prefix = f"{option} {spec}"
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        raise LoadError(f"{prefix}: expected MODULE:FN, e.g. {example}")
    try:
        module = _import(spec, module_name, prefix)
    except LoadError:
        raise
    except SyntaxError as error:
        where = f"{error.filename}:{error.lineno}" if error.filename else module_name
        raise LoadError(f"{prefix}: syntax error in {where}: {error.msg}; fix the file") from error
    except Exception as error:
        missing = error.name if isinstance(error, ModuleNotFoundError) else None
        if missing is not None and module_name.split(".")[0] == missing.split(".")[0]:
            raise LoadError(
                f"{prefix}: cannot import {module_name} ({one_line(error)}); put it on "
                "PYTHONPATH, run from its directory, or pass path/to/file.py:FN"
            ) from error
        raise LoadError(
            f"{prefix}: importing {module_name} failed{_where(error)}: {one_line(error)}"
        ) from error
    found: Any = module
    for part in attr.split("."):
        if not hasattr(found, part):
            raise LoadError(
                f"{prefix}: module {module_name} has no attribute {attr!r}; name {wanted}"
            )
        found = getattr(found, part)
    if not callable(found):
        raise LoadError(f"{prefix}: {attr} is a {type(found).__name__}, not callable")
    return found

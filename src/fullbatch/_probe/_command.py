"""The training command after ``fullbatch probe --``: which Python script or module it runs.

``fullbatch probe`` runs the script in its own interpreter, so the command must be a Python
one: ``python``/``python3``/any ``python*`` executable followed by a script or ``-m module``,
or a Python script given alone (``train.py``, or an executable file whose ``#!`` line names
python). Anything else (a shell script, ``bash run.sh``, ``ls``, a launcher such as
``torchrun``) is refused with the command that would work (docs/probe.md, "One command").
Nothing here imports torch.
"""

from __future__ import annotations

import importlib.util
import os

__all__ = ["CommandError", "target"]

#: Launchers that start Python processes themselves: fullbatch probe runs inside them.
_LAUNCHERS = ("torchrun", "accelerate", "deepspeed", "lightning", "composer")
_SHELLS = ("bash", "sh", "zsh", "dash", "ksh", "fish")


class CommandError(Exception):
    """The training command is not one ``fullbatch probe`` can run: the message says why and
    gives the command that works (the CLI prints it as a usage error, exit 2)."""


def _is_python(word: str) -> bool:
    """``python``, ``python3``, ``python3.12``, ``/usr/bin/python3``, ``.venv/bin/python``.

    >>> [_is_python(w) for w in ("python3.12", "/x/bin/python", "pythonista", "ipython")]
    [True, True, False, False]
    """
    name = os.path.basename(word)
    rest = name.removeprefix("python")
    return name.startswith("python") and all(c.isdigit() or c == "." for c in rest)


def _first_line(path: str) -> str:
    try:
        with open(path, "rb") as file:
            return file.readline(200).decode("utf-8", "replace").strip()
    except OSError:
        return ""


def _python_file(path: str) -> bool:
    """A ``.py`` file, or one whose ``#!`` line runs python (not a ``.sh`` file)."""
    if path.endswith((".py", ".pyw")):
        return True
    if path.endswith((".sh", ".bash", ".zsh")):
        return False
    line = _first_line(path)
    return line.startswith("#!") and "python" in line


def _not_python(words: list[str]) -> CommandError:
    """Why ``words`` is no Python command, with the command that would work."""
    shown = " ".join(words)
    head = os.path.basename(words[0])
    if head in _LAUNCHERS:
        at = next((i for i, w in enumerate(words) if w.endswith(".py")), None)
        example = "torchrun --nproc-per-node 2 -m fullbatch probe [OPTIONS] -- python train.py"
        if head == "torchrun" and at is not None:
            launcher, rest = " ".join(words[:at]), " ".join(words[at:])
            example = f"{launcher} -m fullbatch probe [OPTIONS] -- python {rest}"
        return CommandError(
            f"{shown!r} is not a Python command: {head} starts the Python processes itself, so "
            f"fullbatch probe runs inside it, as the program it launches: {example}"
        )
    if head in _SHELLS or (os.path.isfile(words[0]) and not _python_file(words[0])):
        script = words[1] if head in _SHELLS and len(words) > 1 else words[0]
        return CommandError(
            f"{shown!r} is not a Python command ({script} is a shell script or another "
            f"program): fullbatch probe runs a Python script in its own interpreter; probe the "
            f"Python command inside it: fullbatch probe -- python train.py ARGS (in {script}: "
            f"put 'fullbatch probe --' before its 'python train.py ...' line)"
        )
    inner = next((i for i, w in enumerate(words) if _is_python(w)), None)
    if inner is not None:  # `uv run python train.py`, `env X=1 python train.py`
        wrapped = " ".join([*words[:inner], "fullbatch probe --", *words[inner:]])
        return CommandError(
            f"{shown!r} is not a Python command ({words[0]} runs python itself): put fullbatch "
            f"probe inside it: {wrapped}"
        )
    return CommandError(
        f"{shown!r} is not a Python command: fullbatch probe runs a Python script or module in "
        f"its own interpreter; give it as: fullbatch probe -- python train.py ARGS, or -- "
        f"python -m package.module ARGS"
    )


def target(command: list[str]) -> tuple[str, str, list[str]]:
    """``("path", script, args)`` or ``("module", name, args)`` of a Python command.

    >>> target(["--", "python3", "-m", "json.tool", "x.json"])
    ('module', 'json.tool', ['x.json'])
    >>> target(["--", "ls", "-l"])
    Traceback (most recent call last):
    ...
    fullbatch._probe._command.CommandError: 'ls -l' is not a Python command: ...

    Raises:
        CommandError: no command, not a Python command, a missing script or module.
    """
    words = command[1:] if command[:1] == ["--"] else command
    if not words:
        raise CommandError(
            "no training command; give it after --, e.g. fullbatch probe -- python train.py"
        )
    if _is_python(words[0]):
        python, words = words[:1], words[1:]
    elif os.path.isfile(words[0]) and _python_file(words[0]):
        python = []  # `-- train.py` or `-- ./train` with a python #! line
    else:
        raise _not_python(words)
    if not words:
        raise CommandError(f"{python[0]} without a script; e.g. -- python train.py ARGS")
    if words[0] == "-m":
        if len(words) < 2:
            raise CommandError("python -m needs a module name, e.g. -- python -m mypackage.train")
        if not _module_exists(words[1]):
            raise CommandError(f"no such module: {words[1]}; check the name (-- python -m NAME)")
        return "module", words[1], words[2:]
    if words[0].startswith("-"):
        raise CommandError(
            f"python option {words[0]} is not supported; run the script itself: "
            "-- python train.py ARGS"
        )
    if not os.path.isfile(words[0]):
        raise CommandError(f"no such script: {words[0]}; check the path (-- python train.py)")
    if not _python_file(words[0]) and (
        _first_line(words[0]).startswith("#!") or words[0].endswith((".sh", ".bash", ".zsh"))
    ):
        raise CommandError(
            f"{words[0]} is not a Python script (a shell script: its first line is "
            f"{_first_line(words[0])!r}): fullbatch probe runs a Python script in its own "
            f"interpreter; probe the Python command inside it: fullbatch probe -- python "
            f"train.py ARGS"
        )
    return "path", words[0], words[1:]


def _module_exists(name: str) -> bool:
    """Whether ``python -m name`` would find ``name`` (the current folder first, as it does)."""
    import sys

    sys.path.insert(0, os.getcwd())
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a parent package that does not exist
        return False
    finally:
        sys.path.remove(os.getcwd())

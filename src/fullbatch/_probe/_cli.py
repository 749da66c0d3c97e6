"""``fullbatch probe``: run a training script unchanged under :func:`fullbatch.probe`.

``fullbatch probe [--objective X] [--windows N] [--keep-training] -- python train.py ARGS...``
runs ``train.py`` in this interpreter (as ``python train.py ARGS...`` would: ``__name__`` is
``"__main__"``, ``sys.argv`` is ``["train.py", *ARGS]``, the script's folder first on
``sys.path``; ``python -m package.module`` works too), stops it once the probed windows are
checked (unless ``--keep-training``), prints the report and exits 0 when every probed window is
right, 1 when one is not or nothing was checked, 2 on a usage error (one line on stderr naming
the problem and the fix, no traceback).

Heavy imports (torch) happen inside :func:`run`, so ``fullbatch --help`` stays fast.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from fullbatch._verify._cli import positive_int

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``probe``'s options to its subcommand parser.

    >>> parser = argparse.ArgumentParser()
    >>> add_arguments(parser)
    >>> args = parser.parse_args(["--windows", "2", "--", "python", "train.py", "--lr", "1"])
    >>> args.windows, args.training_command
    (2, ['--', 'python', 'train.py', '--lr', '1'])
    """
    parser.epilog = (
        "exit status: 0 every probed window is right; 1 a window is wrong, or nothing was "
        "checked; 2 usage error. Example: fullbatch probe -- python train.py --lr 3e-4"
    )
    parser.add_argument(
        "--objective",
        default=None,
        metavar="X",
        help="the loss accumulation should equal: causal_lm (next-token mean), token (masked "
        "LM, token classification), sample (one label per row), or MODULE:FN / FILE.py:FN, a "
        "function fn(model, micro) -> (loss_sum, count); default: inferred from a Hugging Face "
        "head",
    )
    parser.add_argument(
        "--windows",
        type=positive_int,
        default=1,
        metavar="N",
        help="optimizer steps to check (default: 1)",
    )
    parser.add_argument(
        "--keep-training",
        action="store_true",
        help="let the script run to its end after the probed windows (default: stop it)",
    )
    parser.add_argument(
        "training_command",
        nargs=argparse.REMAINDER,
        metavar="-- python train.py ARGS",
        help="the training command, after --",
    )


class UsageError(Exception):
    """A bad command line: one line on stderr, exit 2."""


def _fail(message: str) -> int:
    print(f"fullbatch probe: error: {message}", file=sys.stderr)
    return 2


def _target(command: list[str]) -> tuple[str, str, list[str]]:
    """``("path", script, args)`` or ``("module", name, args)`` from ``python ...``."""
    words = command[1:] if command[:1] == ["--"] else command
    if words and os.path.basename(words[0]).startswith("python"):
        words = words[1:]
    if not words:
        raise UsageError(
            "no training command; give it after --, e.g. fullbatch probe -- python train.py"
        )
    if words[0] == "-m":
        if len(words) < 2:
            raise UsageError("python -m needs a module name, e.g. -- python -m mypackage.train")
        if not _module_exists(words[1]):
            raise UsageError(f"no such module: {words[1]}; check the name (-- python -m NAME)")
        return "module", words[1], words[2:]
    if words[0].startswith("-"):
        raise UsageError(
            f"python option {words[0]} is not supported; run the script itself: "
            "-- python train.py ARGS"
        )
    if not os.path.isfile(words[0]):
        raise UsageError(f"no such script: {words[0]}; check the path (-- python train.py)")
    return "path", words[0], words[1:]


def _module_exists(name: str) -> bool:
    """Whether ``python -m name`` would find ``name`` (the current folder first, as it does)."""
    import importlib.util

    sys.path.insert(0, os.getcwd())
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a parent package that does not exist
        return False
    finally:
        sys.path.remove(os.getcwd())


def _objective(spec: str | None) -> Any:
    """A built-in objective's name, or the function a ``MODULE:FN`` / ``FILE.py:FN`` names."""
    from fullbatch._proof._loader import LoadError, load_function
    from fullbatch._proof._objective import OBJECTIVES

    if spec is None or spec in OBJECTIVES:
        return spec
    if ":" not in spec:
        raise UsageError(
            f"--objective {spec}: expected one of {', '.join(OBJECTIVES)} or MODULE:FN, e.g. "
            "--objective mylosses:token_loss"
        )
    try:
        return load_function(
            spec,
            option="--objective",
            wanted="a function fn(model, micro) -> (loss_sum, count)",
            example="mylosses:token_loss",
        )
    except LoadError as error:
        raise UsageError(str(error)) from None


def _execute(kind: str, name: str, args: list[str]) -> int | None:
    """Run the script as ``__main__`` with its own ``sys.argv``; its exit status if it exited."""
    import runpy

    saved_argv, saved_path = sys.argv[:], sys.path[:]
    try:
        if kind == "path":
            sys.argv = [name, *args]
            sys.path.insert(0, os.path.dirname(os.path.abspath(name)))
            runpy.run_path(name, run_name="__main__")
        else:
            sys.argv = [name, *args]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(name, run_name="__main__", alter_sys=True)
    except SystemExit as error:
        code = error.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return None


def run(args: argparse.Namespace) -> int:
    """Run the command under the probe; print the report. 0 right, 1 wrong or nothing, 2 usage."""
    try:
        kind, name, script_args = _target(list(args.training_command))
        objective = _objective(args.objective)
    except UsageError as error:
        return _fail(str(error))
    from fullbatch._probe._run import Probe, ProbeFinished

    probe = Probe(
        None, None, objective=objective, windows=args.windows, ranks=None,
        stop=not args.keep_training,
    )  # fmt: skip
    status = None
    with probe:
        try:
            status = _execute(kind, name, script_args)
        except ProbeFinished:
            status = None
        except Exception as error:
            if error is probe.failed:  # the probe's own check could not run: a usage error
                hint = " (here: --objective causal_lm, token, sample or FILE.py:FN)"
                return _fail(str(error).rstrip(".") + (hint if "objective=" in str(error) else ""))
            import traceback

            traceback.print_exc()  # the script's own error, as python would show it
            status = 1
    report = probe.report
    print(report)
    if status not in (None, 0):
        print(f"note: the script ended with status {status}")
    return 0 if report.ok else 1

"""``fullbatch probe``: run a training script unchanged under :func:`fullbatch.probe`.

``fullbatch probe [--objective X] [--windows N|all] [--keep-training] -- python train.py
ARGS...`` runs ``train.py`` in this interpreter (as ``python train.py ARGS...`` would:
``__name__`` is ``"__main__"``, ``sys.argv`` is ``["train.py", *ARGS]``, the script's folder
first on ``sys.path``; ``python -m package.module`` works too), checks the first two windows
(``--windows``), stops it once they are checked (unless ``--keep-training``) and prints the
report. Exit status (:func:`exit_status`): 0 every probed window right, 1 one is wrong, 2 a
usage error (one line on stderr naming the problem and the fix, no traceback), 3 nothing
checked; a script that fails after right windows exits with its own status. Under
``torchrun`` every rank runs the probe and reaches the same verdict; rank 0 alone prints it.

Heavy imports (torch) happen inside :func:`run`, so ``fullbatch --help`` stays fast.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from fullbatch._verify._cli import positive_int

__all__ = ["RIGHT", "UNCHECKED", "USAGE", "WRONG", "add_arguments", "exit_status", "run"]

#: Exit statuses of ``fullbatch probe``.
RIGHT, WRONG, USAGE, UNCHECKED = 0, 1, 2, 3


def windows_arg(text: str) -> int | str:
    """argparse type of ``--windows``: a positive integer or ``all``."""
    if text == "all":
        return text
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected a positive integer or all, got {text!r} (e.g. --windows 2, --windows all)"
        ) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``probe``'s options to its subcommand parser.

    >>> parser = argparse.ArgumentParser()
    >>> add_arguments(parser)
    >>> args = parser.parse_args(["--windows", "3", "--", "python", "train.py", "--lr", "1"])
    >>> args.windows, args.training_command
    (3, ['--', 'python', 'train.py', '--lr', '1'])
    >>> parser.parse_args(["--windows", "all"]).windows, parser.parse_args([]).windows
    ('all', None)
    """
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (
        "exit status:\n"
        "  0  every probed window is right\n"
        "  1  a probed window is wrong (the report names the mistake and the fix)\n"
        "  2  usage error: a bad option, a missing script, an objective that cannot be "
        "inferred\n"
        "  3  nothing checked: no optimizer step, no micro-batch, or the script failed before\n"
        "     a window ended\n"
        "  a script that fails after right windows (--keep-training) exits with its own status\n"
        "\n"
        "Under torchrun every rank runs the probe and exits with the same status; rank 0\n"
        "prints the report.\n"
        "\n"
        "examples:\n"
        "  fullbatch probe -- python train.py --lr 3e-4\n"
        "  fullbatch probe --objective causal_lm --windows all -- python -m mypackage.train\n"
        "  torchrun --nproc-per-node 2 -m fullbatch probe -- python train.py"
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
        type=windows_arg,
        default=None,
        metavar="N|all",
        help="windows to check (a window: what the optimizers apply at one step, however many "
        "step together); default: the first 2 (a gradient left over by a missing zero_grad() "
        "shows only in the second); all: every window until the script ends",
    )
    parser.add_argument(
        "--keep-training",
        action="store_true",
        help="let the script run to its end after the probed windows (default: stop it); a "
        "script that then fails exits with its own status",
    )
    parser.add_argument(
        "training_command",
        nargs=argparse.REMAINDER,
        metavar="-- python train.py ARGS",
        help="the training command, after --",
    )


class UsageError(Exception):
    """A bad command line: one line on stderr, exit 2."""


def _rank() -> int:
    """This process's rank: the default process group's when the script set one up, else
    torchrun's ``RANK`` (0 outside torchrun); torch is not imported for it."""
    if "torch" in sys.modules:
        from fullbatch._base._sync._probe import default_rank

        rank = default_rank()
        if rank is not None:
            return rank
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _fail(message: str) -> int:
    if _rank() == 0:
        print(f"fullbatch probe: error: {message}", file=sys.stderr)
    return USAGE


def exit_status(report: Any, script_status: int | None) -> int:
    """``fullbatch probe``'s exit status from its report and the script's own exit status
    (None: it did not fail: it ended, or the probe stopped it).

    A window judged wrong: 1. No window judged (no step, no micro-batch, an unsupported
    engine, the script failed before a window ended), or one that had nothing to check: 3.
    Every window right but the script failed: the script's status. Else 0.

    >>> from fullbatch._probe._report import ProbeReport, WindowCheck
    >>> def window(ok, pattern):
    ...     return WindowCheck(1, ok, 0.0, 0.0, 0.0, 1, 1.0, (1.0,), 0.0, "", pattern, "", "")
    >>> right, wrong = window(True, "right"), window(False, "dropped")
    >>> [exit_status(ProbeReport((right,)), None), exit_status(ProbeReport((wrong,)), 4),
    ...  exit_status(ProbeReport(()), 1), exit_status(ProbeReport((right,)), 4)]
    [0, 1, 3, 4]
    """
    from fullbatch._probe._report import UNCHECKED as unchecked

    judged = [w for w in report.windows if w.pattern not in unchecked]
    if any(not w.ok for w in judged):
        return WRONG
    if not judged or not report.ok:
        return UNCHECKED
    if script_status not in (None, 0):
        return int(script_status)
    return RIGHT


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
    from fullbatch._proof._objective import OBJECTIVES, RENAMED

    if spec in RENAMED:  # an earlier release's name: said once, run under its current name
        if _rank() == 0:
            print(
                f"fullbatch probe: note: --objective {spec} is deprecated: it is now "
                f"--objective {RENAMED[spec]} (same loss, same count)",
                file=sys.stderr,
            )
        return RENAMED[spec]
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
        if code is None or isinstance(code, int):
            return code or None
        print(code, file=sys.stderr)  # sys.exit("message"): python prints it, status 1
        return 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return None


def run(args: argparse.Namespace) -> int:
    """Run the command under the probe; print the report (rank 0); the :func:`exit_status`."""
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
    code = exit_status(report, status)
    if _rank() == 0:
        print(report)
        if status not in (None, 0):
            print(f"note: the script failed (exit status {status}); fullbatch probe exits {code}")
    return code

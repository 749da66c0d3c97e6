"""``fullbatch probe``: run a training script unchanged under :func:`fullbatch.probe`.

``fullbatch probe [--objective X] [--windows N|all] [--keep-training] [--json PATH] [--plot
PATH] -- python train.py ARGS...`` runs ``train.py`` in this interpreter (as ``python train.py
ARGS...`` would: ``__name__`` is ``"__main__"``, ``sys.argv`` is ``["train.py", *ARGS]``, the
script's folder first on ``sys.path``; ``python -m package.module`` works too; anything but a
Python command is refused: :mod:`fullbatch._probe._command`), checks the first two windows
(``--windows``), stops it once they are checked (unless ``--keep-training``, which also keeps
it running whatever the probe fails on) and prints the report. Exit status
(:func:`exit_status`, :data:`STATUSES`): 0 right, 1 wrong, 2 usage error, 3 nothing checked, 4
the script failed after right windows. Under ``torchrun`` every rank runs the probe and
reaches the same verdict; rank 0 alone prints it (and writes ``--json``/``--plot``).

Heavy imports (torch) happen inside :func:`run`, so ``fullbatch --help`` stays fast.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from typing import Any

from fullbatch._verify._cli import positive_int

__all__ = [
    "FAILED", "RIGHT", "STATUSES", "UNCHECKED", "USAGE", "WRONG", "add_arguments",
    "exit_status", "run",
]  # fmt: skip

#: Exit statuses of ``fullbatch probe``: none of them is ever the script's own.
RIGHT, WRONG, USAGE, UNCHECKED, FAILED = 0, 1, 2, 3, 4

#: What each exit status means (``--help`` and docs/probe.md say the same).
STATUSES = {
    RIGHT: "every probed window is right (and the script ran to its end or was stopped after them)",
    WRONG: "a probed window is wrong (the report names the mistake and the fix), whatever the "
    "script did afterwards",
    USAGE: "usage error: a bad option, a missing script, not a Python command, an objective "
    "that cannot be inferred (found at the model's first forward, before any step) or that "
    "fails",
    UNCHECKED: "nothing checked: no optimizer step, no micro-batch, an engine the probe cannot "
    "read, or the script failed before a window was checked",
    FAILED: "the script failed (an exception, or its own non-zero exit status) after right "
    "windows: its traceback and status are shown, its status is in --json",
}


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
    lines = ["exit status (never the script's own):"]
    for code, meaning in STATUSES.items():
        lines += [f"  {code}  {line}" if i == 0 else f"     {line}"
                  for i, line in enumerate(textwrap.wrap(meaning, 84))]  # fmt: skip
    parser.epilog = "\n".join(lines) + (
        "\n\n"
        "Under torchrun every rank runs the probe and exits with the same status; rank 0\n"
        "prints the report (torchrun itself exits 1 when any rank exits non-zero: read --json).\n"
        "\n"
        "examples:\n"
        "  fullbatch probe -- python train.py --lr 3e-4\n"
        "  fullbatch probe --objective causal_lm --windows all -- python -m mypackage.train\n"
        "  fullbatch probe --keep-training --json probe.json -- python train.py\n"
        "  torchrun --nproc-per-node 2 -m fullbatch probe -- python train.py"
    )
    parser.add_argument(
        "--objective",
        default=None,
        metavar="X",
        help="the loss accumulation should equal: causal_lm (next-token mean), token (masked "
        "LM, token classification), sample (one label per row), causal_lm+moe (a MoE model: "
        "plus its load balancing over the window), or MODULE:FN / FILE.py:FN, a "
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
        help="let the script run to its end after the probed windows (default: stop it), "
        "whatever the probe fails on (the report says what it could not check)",
    )
    parser.add_argument(
        "--json",
        default=None,
        metavar="PATH",
        help="also write the report as data to PATH (schema: docs/probe.md, 'The report as data')",
    )
    parser.add_argument(
        "--plot",
        default=None,
        metavar="PATH",
        help="also draw the weights per micro-batch per window with their precision, and each "
        "window's error against its tolerance, to PATH (a .png; needs matplotlib)",
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


def exit_status(report: Any, script_status: int | None, *, probe_failed: bool = False) -> int:
    """``fullbatch probe``'s exit status from its report, the script's own exit status (None:
    it did not fail: it ended, or the probe stopped it) and whether the probe's own check
    failed (the declared objective could not be inferred or computed).

    First that holds: a window judged wrong, 1; the probe failed, 2; no window judged (no
    step, no micro-batch, an unsupported engine, the script failed before a window ended), 3;
    the script failed after right windows, 4 (never its own status: a script's 1 or 3 would
    read as WRONG or nothing checked); a window left unchecked, 3; else 0.

    >>> from fullbatch._probe._report import ProbeReport, WindowCheck
    >>> def window(ok, pattern):
    ...     return WindowCheck(1, ok, 0.0, 0.0, 0.0, 1, 1.0, (1.0,), 0.0, "", pattern, "", "")
    >>> right, wrong = window(True, "right"), window(False, "dropped")
    >>> [exit_status(ProbeReport((right,)), None), exit_status(ProbeReport((wrong,)), 4),
    ...  exit_status(ProbeReport(()), 1), exit_status(ProbeReport((right,)), 3),
    ...  exit_status(ProbeReport((right,)), None, probe_failed=True)]
    [0, 1, 3, 4, 2]
    """
    from fullbatch._probe._report import UNCHECKED as unchecked

    judged = [w for w in report.windows if w.pattern not in unchecked]
    if any(not w.ok for w in judged):
        return WRONG
    if probe_failed:
        return USAGE
    if not judged:
        return UNCHECKED
    if script_status not in (None, 0):
        return FAILED
    if not report.ok:
        return UNCHECKED
    return RIGHT


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
    if spec is None or spec in (*OBJECTIVES, "causal_lm+moe"):  # +moe: docs/moe.md
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


def _writers(args: argparse.Namespace) -> list[Any]:
    """What ``--json`` and ``--plot`` write after the run, each ``write(report, code, status)``;
    a usage error now (a folder that does not exist, no matplotlib), before anything runs."""
    writers = []
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        if path is None:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise UsageError(f"{option} {path}: no such folder {folder}; create it first")
    if args.json is not None:
        path = os.path.abspath(args.json)

        def write_json(report: Any, code: int, status: int | None) -> None:
            import json

            data = {**report.to_dict(), "exit_status": code, "script_status": status}
            with open(path, "w") as file:
                json.dump(data, file, indent=1, allow_nan=False)
                file.write("\n")

        writers.append(write_json)
    if args.plot is not None:
        from fullbatch._probe._plot import check_matplotlib

        why = check_matplotlib()
        if why is not None:
            raise UsageError(why)
        plot_path = os.path.abspath(args.plot)

        def write_plot(report: Any, code: int, status: int | None) -> None:
            from fullbatch._probe._plot import plot_report

            plot_report(report, plot_path)

        writers.append(write_plot)
    return writers


def _usage_text(error: BaseException) -> str:
    """The probe's own failure in the command line's words."""
    from fullbatch._probe._run import ObjectiveUnknown

    text = str(error).strip()
    if isinstance(error, ObjectiveUnknown):
        why = text.split(": ", 1)[-1].split("; pass", 1)[0]
        return (
            f"no --objective given, and {why}; pass --objective causal_lm, token, sample or "
            f"FILE.py:FN (stopped at the model's first forward, before any step)"
        )
    hint = " (here: --objective causal_lm, token, sample or FILE.py:FN)"
    return text.rstrip(".") + (hint if "objective=" in text else "")


def _script_failure(status: int | None, error: BaseException | None) -> str:
    if error is not None:
        return (
            f"the script raised {type(error).__name__}: {error} (exit status 1 without the probe)"
        )
    return f"the script exited with status {status}"


def run(args: argparse.Namespace) -> int:
    """Run the command under the probe; print the report (rank 0); the :func:`exit_status`."""
    from fullbatch._probe._command import CommandError, target

    try:
        kind, name, script_args = target(list(args.training_command))
        objective = _objective(args.objective)
        writers = _writers(args)
    except (CommandError, UsageError) as error:
        return _fail(str(error))
    from fullbatch._probe._run import Probe, ProbeFinished

    probe = Probe(
        None, None, objective=objective, windows=args.windows, ranks=None,
        stop=not args.keep_training, keep_going=args.keep_training,
    )  # fmt: skip
    status, raised = None, None
    with probe:
        try:
            status = _execute(kind, name, script_args)
        except ProbeFinished:
            status = None
        except Exception as error:
            if error is not probe.failed:  # else the probe's own check failed: said below
                import traceback

                traceback.print_exc()  # the script's own error, as python would show it
                status, raised = 1, error
        if status not in (None, 0):
            probe.note_failure(_script_failure(status, raised))
    report = probe.report
    failed = probe.failed is not None and not isinstance(probe.failed, ProbeFinished)
    code = exit_status(report, status, probe_failed=failed)
    if _rank() == 0:
        if failed and probe.failed is not None:
            print(f"fullbatch probe: error: {_usage_text(probe.failed)}", file=sys.stderr)
        print(report)
        if status not in (None, 0):
            print(f"note: the script failed (exit status {status}); fullbatch probe exits {code}")
        for write in writers:
            write(report, code, status)
    return code

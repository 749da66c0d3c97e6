"""``fullbatch probe``: run a training script unchanged under :func:`fullbatch.probe`.

``fullbatch probe [--objective X] [--windows N|all] [--keep-training] [--json PATH] [--plot
PATH] -- python train.py ARGS...`` runs ``train.py`` in this interpreter (as ``python train.py
ARGS...`` would: ``__name__`` is ``"__main__"``, ``sys.argv`` is ``["train.py", *ARGS]``, the
script's folder first on ``sys.path``; ``python -m package.module`` works too; anything but a
Python command is refused: :mod:`fullbatch._probe._command`), checks the first two windows
(``--windows``), stops it once they are checked (unless ``--keep-training``, which also keeps
it running whatever the probe fails on) and prints the report. Its options and ``--help``
are :mod:`fullbatch._probe._cli_args`; how a run ends (exit status: 0 right, 1 wrong, 2
usage error, 3 nothing checked, 4 the script failed after right windows; the probe's failure
in the command line's words) is :mod:`fullbatch._probe._cli_outcome`. Under ``torchrun``
every rank runs the probe and reaches the same verdict; rank 0 alone prints it (and writes
``--json``/``--plot``).

Heavy imports (torch) happen inside :func:`run`, so ``fullbatch --help`` stays fast.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from fullbatch._probe._cli_args import add_arguments
from fullbatch._probe._cli_outcome import (
    exit_status,
    fail,
    rank,
    script_failure,
    usage_text,
)

__all__ = ["UsageError", "add_arguments", "run"]


class UsageError(Exception):
    """A bad command line: one line on stderr, exit 2."""


def _objective(spec: str | None) -> Any:
    """A built-in objective's name, or the function a ``MODULE:FN`` / ``FILE.py:FN`` names."""
    from fullbatch._proof._loader import LoadError, load_function
    from fullbatch._proof._objective import OBJECTIVES, RENAMED

    if spec in RENAMED:  # an earlier release's name: said once, run under its current name
        if rank() == 0:
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


def run(args: argparse.Namespace) -> int:
    """Run the command under the probe; print the report (rank 0); the :func:`exit_status`."""
    from fullbatch._probe._command import CommandError, target

    try:
        kind, name, script_args = target(list(args.training_command))
        objective = _objective(args.objective)
        if getattr(args, "coupled", False) and not callable(objective):
            raise UsageError(
                f"--coupled declares that --objective FILE.py:FN couples rows, got --objective "
                f"{args.objective}; e.g. --objective losses.py:info_nce --coupled"
            )
        writers = _writers(args)
    except (CommandError, UsageError) as error:
        return fail(str(error))
    from fullbatch._probe._run import Probe, ProbeFinished

    probe = Probe(
        None, None, objective=objective, windows=args.windows, ranks=None,
        stop=not args.keep_training, keep_going=args.keep_training,
        coupled=getattr(args, "coupled", False),
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
            probe.note_failure(script_failure(status, raised))
    report = probe.report
    failed = probe.failed is not None and not isinstance(probe.failed, ProbeFinished)
    code = exit_status(report, status, probe_failed=failed)
    if rank() == 0:
        if failed and probe.failed is not None:
            print(f"fullbatch probe: error: {usage_text(probe.failed)}", file=sys.stderr)
        print(report)
        if status not in (None, 0):
            print(f"note: the script failed (exit status {status}); fullbatch probe exits {code}")
        for write in writers:
            write(report, code, status)
    if status in (None, 0) and not failed:  # not after a failure: a rank may be in a collective
        from fullbatch._base._sync._probe import release_process_group

        release_process_group()
    return code

"""``fullbatch probe``'s command line: its options, its ``--help`` and its exit statuses.

The statuses' meanings (:data:`STATUSES`) are printed by ``--help`` and listed in
docs/probe.md; :func:`fullbatch._probe._cli_outcome.exit_status` picks one. Nothing heavy is
imported here, so ``fullbatch --help`` stays fast.
"""

from __future__ import annotations

import argparse
import textwrap

from fullbatch._verify._cli import positive_int

__all__ = [
    "FAILED", "RIGHT", "STATUSES", "UNCHECKED", "USAGE", "WRONG", "add_arguments", "windows_arg",
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
        "function fn(model, micro) -> (loss_sum, count); default: the trainer's own where the "
        "probe computes it (ExactTrainer's loss=, TRL's SFTTrainer and DPOTrainer), else "
        "inferred from a Hugging Face head; another trainer's (KTO, GRPO, ...) exits 2 before "
        "anything trains",
    )
    parser.add_argument(
        "--coupled",
        action="store_true",
        help="the --objective FN couples rows (in-batch negatives): compare each step with FN "
        "over the whole window's rows as one batch, as window.run_coupled makes it",
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

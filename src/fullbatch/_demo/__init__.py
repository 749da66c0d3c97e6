"""``fullbatch demo``: train a small causal LM three ways and show which one is the full batch.

This module only declares the options, so that ``fullbatch --help`` imports nothing heavy; the
work happens in :mod:`fullbatch._demo._main`, imported by :func:`run`:

- ``_main``: the demo from top to bottom; ``_deps``: the ``demo`` extra, checked first;
- ``_model``, ``_corpus``: the tiny model and tokenizer, the standard library's docstrings;
- ``_arms``, ``_experiment``: the recipes compared, trained in lockstep;
- ``_report``, ``_plot``: the table, ``metrics.csv``, the verdict and ``loss.png``;
- ``_trl_tiny``: tiny models built in code for the TRL examples (``fb.testing``).

>>> import argparse
>>> from fullbatch import _demo
>>> parser = argparse.ArgumentParser()
>>> _demo.add_arguments(parser)
>>> parser.parse_args(["--micro-batch-sizes", "4,1"]).micro_batch_sizes
(1, 4)
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["add_arguments", "run"]

_EPILOG = """\
With the defaults it takes about two minutes on two CPU cores and downloads nothing.

what it does:
  Every arm starts from the same weights and sees the same batches of standard-library
  docstrings (byte-level, variable length, padding labelled -100):
    full batch       one forward and backward over the whole batch (the reference)
    rows permuted    the full batch with its rows shuffled: exact too, differs by rounding
    naive            per-micro-batch mean loss / number of micro-batches (the 2024 bug)
    fullbatch        fb.Accumulator: summed losses, divided by the window's token count
  At every step, each recipe's gradient is also computed at the full-batch arm's current
  weights (the shadow gradient) and compared with the full-batch gradient there.

output (in --out):
  metrics.csv  one row per step and arm: step, arm, micro_batch_size, true_loss,
               reported_loss, shadow_grad_error, param_distance
  loss.png     loss minus full-batch loss (and its size on a log scale), shadow-gradient
               error, parameter distance to the full batch, logged minus true loss

exit status:
  0  fullbatch's shadow-gradient error stayed below 1e-5 (float32 rounding is about 1e-7) at
     every step, and every naive micro-batch size exceeded it at some step
  1  fullbatch exceeded the tolerance, or the data did not show naive's error
  2  bad options, a missing dependency (pip install 'fullbatch[demo]'), or an unloadable --model
"""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def _sizes(text: str) -> tuple[int, ...]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected a comma list such as 1,2,4, got {text!r}")
    return tuple(sorted({_positive_int(p) for p in parts}))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the demo's options on ``parser`` (the ``demo`` subcommand's parser)."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = _EPILOG
    parser.add_argument(
        "--steps",
        type=_positive_int,
        default=100,
        help="optimizer steps per arm (default: %(default)s)",
    )
    parser.add_argument(
        "--batch-size",
        type=_positive_int,
        default=8,
        help="rows per full batch, i.e. per window (default: %(default)s)",
    )
    parser.add_argument(
        "--micro-batch-sizes",
        type=_sizes,
        default=(1, 2, 4),
        metavar="M,M,...",
        help="micro-batch sizes for naive and fullbatch, each smaller than "
        "--batch-size (default: 1,2,4)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seeds the initial weights, the data order and the row "
        "permutations (default: %(default)s)",
    )
    parser.add_argument(
        "--lr",
        type=_positive_float,
        default=None,
        help="learning rate (default: 3e-3 with AdamW, 1e-2 with SGD)",
    )
    parser.add_argument(
        "--optimizer",
        choices=("adamw", "sgd"),
        default=None,
        help="default: adamw for the built-in model, sgd with --model",
    )
    parser.add_argument(
        "--max-length",
        type=_positive_int,
        default=128,
        help="tokens per row at most; longer docstrings are cut (default: %(default)s)",
    )
    parser.add_argument(
        "--model",
        metavar="PATH",
        default=None,
        help="a local Hugging Face causal LM checkpoint and its tokenizer (loaded "
        "with local_files_only=True: nothing is downloaded) instead of the built-in "
        "tiny Llama. Defaults to SGD, which keeps no optimizer state, so the "
        "full-batch arm needs only the model's memory; the demo holds one copy per "
        "arm plus a shadow copy (9 with the default micro-batch sizes)",
    )
    parser.add_argument(
        "--device", default="cpu", help="torch device for every arm (default: %(default)s)"
    )
    parser.add_argument(
        "--threads",
        type=_positive_int,
        default=1,
        help="CPU threads for torch (default: %(default)s: the model is tiny, so more "
        "threads mostly wait on each other, and on a shared machine they contend with other "
        "jobs; the numbers do not depend on it)",
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        default="fullbatch-demo",
        help="where metrics.csv and loss.png go (default: ./%(default)s)",
    )


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns the exit status described in ``fullbatch demo --help``."""
    from fullbatch._demo._deps import MissingExtraError, require_demo_extra

    if any(m >= args.batch_size for m in args.micro_batch_sizes):
        too_big = ",".join(str(m) for m in args.micro_batch_sizes if m >= args.batch_size)
        print(
            f"fullbatch demo: error: --micro-batch-sizes {too_big} not smaller than "
            f"--batch-size {args.batch_size}: nothing would be accumulated; pass smaller "
            f"sizes or a larger --batch-size",
            file=sys.stderr,
        )
        return 2
    try:
        require_demo_extra()
    except MissingExtraError as exc:
        print(f"fullbatch demo: error: {exc}", file=sys.stderr)
        return 2
    from fullbatch._demo._main import main

    return main(args)

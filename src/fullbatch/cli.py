"""The ``fullbatch`` command line: ``fullbatch demo``, ``fullbatch verify``, ``fullbatch probe``.

Each subcommand lives in its own module that provides ``add_arguments(parser)`` and
``run(args) -> int``; this file only wires them together, so ``fullbatch --help`` stays fast
(heavy imports happen inside ``run``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from fullbatch import __version__

# subcommand -> (module, one-line help)
_SUBCOMMANDS = {
    "demo": ("fullbatch._demo", "train a tiny causal LM: full batch vs naive vs fullbatch"),
    "verify": ("fullbatch._verify._cli", "prove fullbatch equals the full batch on your model"),
    "probe": ("fullbatch._probe._cli", "check a training script's accumulation while it runs"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fullbatch",
        description="Gradient accumulation that trains exactly like the full batch.",
    )
    parser.add_argument("--version", action="version", version=f"fullbatch {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in _SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(sub_parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    module = importlib.import_module(_SUBCOMMANDS[args.command][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

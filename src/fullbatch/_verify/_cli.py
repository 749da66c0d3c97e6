"""``fullbatch verify``: prove on your own model that fullbatch equals the full batch.

Exit codes: 0 equivalent, 1 above tolerance (or not accumulable exactly), 2 bad input (one line
on stderr naming the problem and the fix, no traceback): unreadable data or model, a loss_fn
that does not return ``(loss_sum, count)``, a forward that raises, rows longer than the model's
context (``--max-length`` cuts them), or a ``--micro-batch-size`` that leaves one micro-batch.

Examples::

    fullbatch verify --model ./my-checkpoint --data train.jsonl --micro-batch-size 2
    fullbatch verify --model mymodels:make_model --data prompts.txt --micro-batch-size 4 \\
        --batch-size 16 --dtype float64
    fullbatch verify --model ./my-checkpoint --data train.jsonl --pack --micro-batch-tokens 512
    fullbatch verify --model ./my-moe-checkpoint --data train.jsonl --micro-batch-size 2 --moe

Heavy imports (torch, transformers) happen inside :func:`run`, so ``fullbatch --help`` stays
fast.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["add_arguments", "positive_int", "run"]

_DTYPES = ("float32", "float64")
_AUTOCAST = ("bfloat16", "float16")


def positive_int(text: str) -> int:
    """argparse type: a positive integer (``--micro-batch-size``, ``--windows``)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``verify``'s options to its subcommand parser.

    >>> parser = argparse.ArgumentParser()
    >>> add_arguments(parser)
    >>> args = parser.parse_args(["--model", "m:f", "--data", "d.txt", "--micro-batch-size", "2"])
    >>> args.micro_batch_size, args.dtype
    (2, None)
    """
    parser.add_argument(
        "--model",
        required=True,
        metavar="PATH|MODULE:FACTORY",
        help="a local Hugging Face causal-LM checkpoint directory (loaded offline), or "
        "module:factory / file.py:factory: a callable returning a model or (model, loss_fn) "
        "with loss_fn(model, micro) -> (loss_sum, count)",
    )
    parser.add_argument(
        "--data",
        required=True,
        metavar="FILE",
        help='.jsonl: one list of token ids or {"input_ids": [...]} per line (.json: also one '
        "array of them); other files: plain text, one example per line (checkpoint tokenizer, "
        "else byte-level)",
    )
    parser.add_argument(
        "--micro-batch-size",
        type=positive_int,
        default=None,
        metavar="M",
        help="rows per micro-batch (checks fullbatch's accumulation)",
    )
    parser.add_argument(
        "--pack",
        action="store_true",
        help="check padding-free packing instead (with --micro-batch-tokens): the loss on "
        "packed micro-batches against the same rows padded, and a leak probe across rows",
    )
    parser.add_argument(
        "--micro-batch-tokens",
        type=positive_int,
        default=None,
        metavar="T",
        help="with --pack: real tokens per packed micro-batch",
    )
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        default=None,
        metavar="B",
        help="use the first B examples as the batch (default: all of them)",
    )
    parser.add_argument(
        "--dtype",
        choices=_DTYPES,
        default=None,
        help="cast the model to this dtype (default: float32 for a checkpoint, the factory's "
        "dtype otherwise); float64 gives the tightest check (tolerance 1e-10)",
    )
    parser.add_argument(
        "--autocast",
        choices=_AUTOCAST,
        default=None,
        help="run forward and loss under torch.autocast in this dtype, as mixed-precision "
        "training does; fullbatch then passes within 4x the model's own rounding band",
    )
    parser.add_argument(
        "--max-length",
        type=positive_int,
        default=None,
        metavar="N",
        help="cut every example to its first N tokens (e.g. the model's context length)",
    )
    parser.add_argument(
        "--moe",
        action="store_true",
        help="a transformers MoE model (router_aux_loss_coef, num_experts_per_tok): measure "
        "each way to accumulate its load-balancing loss against the full batch (exact with "
        "window.stats, the running mean, per micro-batch) on a float64 copy, with the "
        "model's own loss (docs/moe.md)",
    )
    parser.add_argument("--device", default="cpu", help="device to run on (default: cpu)")


def _fail(message: str) -> int:
    print(f"fullbatch verify: error: {message}", file=sys.stderr)
    return 2


def _examples(args: argparse.Namespace, loaded: Any) -> tuple[list[Any], list[str]]:
    """The batch's examples (first --batch-size, cut to --max-length) and notes for the report."""
    from fullbatch._verify._data import read_examples, truncate
    from fullbatch._verify._load import InputError, context_length

    examples = read_examples(args.data, tokenizer=loaded.tokenizer, vocab_size=loaded.vocab_size)
    notes = []
    if args.batch_size is not None:
        if len(examples) < args.batch_size:
            raise InputError(
                f"--batch-size {args.batch_size}: {args.data} has only {len(examples)} "
                "examples; lower --batch-size or add examples"
            )
        examples = examples[: args.batch_size]
    if args.max_length is not None:
        examples, cut = truncate(examples, args.max_length)
        notes.append(f"rows cut to --max-length {args.max_length} tokens ({cut} were longer)")
    context = context_length(loaded.model)
    longest = max((len(e.input_ids) for e in examples), default=0)
    if context is not None and longest > context[0]:
        raise InputError(
            f"--data {args.data}: the longest row has {longest} tokens but the model has a "
            f"context of {context[0]} tokens ({context[1]}); pass --max-length {context[0]} to "
            "cut rows"
        )
    return examples, notes


def _batch(args: argparse.Namespace, loaded: Any) -> tuple[dict[str, Any], list[str]]:
    from fullbatch._verify._data import collate
    from fullbatch._verify._load import InputError

    examples, notes = _examples(args, loaded)
    if len(examples) < 2:
        raise InputError(
            f"--data {args.data}: {len(examples)} example(s); verify needs at least 2 rows to "
            "split into micro-batches and to check additivity"
        )
    if args.pack:
        pass  # verify(pack=True) refuses a budget that leaves every micro-batch one row
    elif args.micro_batch_size >= len(examples):
        raise InputError(
            f"--micro-batch-size {args.micro_batch_size} >= the batch's {len(examples)} rows: "
            "one micro-batch accumulates nothing, so the comparison would prove nothing; pass "
            f"--micro-batch-size {len(examples) // 2} or less, or more examples"
        )
    if all(len(e.input_ids) < 2 for e in examples):
        raise InputError(
            f"--data {args.data}: every example has a single token, so there is no next token "
            "to predict; give examples of 2 tokens or more"
        )
    batch = {k: v.to(args.device) for k, v in collate(examples, loaded.pad_id).items()}
    return batch, notes


def _guarded(loss_fn: Any, prefix: str, culprit: str) -> Any:
    """``loss_fn`` whose errors (its own, or the model's forward) become one-line InputErrors."""
    from fullbatch._proof._objective import check_loss_output
    from fullbatch._verify._load import InputError, one_line

    def guarded_loss_fn(model: Any, micro: Any) -> Any:
        try:
            out = loss_fn(model, micro)
        except InputError:
            raise
        except Exception as error:
            raise InputError(
                f"{prefix}: {culprit} raised {one_line(error)}; call it on a few rows of --data "
                "outside verify to see the traceback"
            ) from error
        try:
            check_loss_output(out)
        except (TypeError, ValueError) as error:
            raise InputError(f"{prefix}: {str(error).rstrip('.')}") from error
        return out

    return guarded_loss_fn


def run(args: argparse.Namespace) -> int:
    """Load the model and data, run :func:`fullbatch.verify`, print the report.

    Returns 0 when equivalent, 1 when not, 2 on bad input.
    """
    import dataclasses

    import torch

    from fullbatch._verify._data import require_file
    from fullbatch._verify._load import InputError, causal_lm_loss_fn, load_model
    from fullbatch._verify._pack_run import packed_loss_fn
    from fullbatch._verify._run import verify

    if args.pack == (args.micro_batch_size is not None) or args.pack != (
        args.micro_batch_tokens is not None
    ):
        return _fail(
            "give --micro-batch-size M (fullbatch's accumulation), or --pack with "
            "--micro-batch-tokens T (padding-free packing); got "
            f"--micro-batch-size {args.micro_batch_size}, --pack {args.pack}, "
            f"--micro-batch-tokens {args.micro_batch_tokens}"
        )
    if args.moe and (args.pack or args.autocast):
        return _fail(
            "--moe measures the load-balancing loss in float64 on padded micro-batches; drop "
            f"--pack and --autocast (got --pack {args.pack}, --autocast {args.autocast})"
        )
    dtype = getattr(torch, args.dtype) if args.dtype else None
    autocast = getattr(torch, args.autocast) if args.autocast else None
    try:
        require_file(args.data)  # before the model load: a typo should fail fast
        loaded = load_model(args.model, dtype=dtype, device=args.device)
        batch, notes = _batch(args, loaded)
        prefix = f"--model {args.model}"
        if loaded.loss_fn is None:
            default = packed_loss_fn if args.pack else causal_lm_loss_fn
            loss_fn = _guarded(default, prefix, "the model's forward")
        else:
            loss_fn = _guarded(loaded.loss_fn, prefix, "the model or its loss_fn")
        if args.moe and loaded.loss_fn is not None:
            raise InputError(
                f"{prefix}: --moe checks the model's own loss, but the factory returned a "
                "loss_fn; return the model alone"
            )
        try:
            if args.moe:
                from fullbatch._verify._moe import verify_moe  # verify(..., moe=True)'s body

                report: Any = verify_moe(
                    loaded.model, batch, micro_batch_size=args.micro_batch_size
                )
            elif args.pack:
                report = verify(
                    loaded.model,
                    batch,
                    loss_fn,
                    micro_batch_tokens=args.micro_batch_tokens,
                    pack=True,
                    dtype=dtype,
                )
            else:
                report = verify(
                    loaded.model,
                    batch,
                    loss_fn,
                    micro_batch_size=args.micro_batch_size,
                    autocast=autocast,
                )
        except (TypeError, ValueError) as error:  # verify's own checks: bad input
            raise InputError(str(error).rstrip(".")) from error
    except InputError as error:
        return _fail(str(error))
    if notes and not args.moe:
        both = (*report.notes, *notes)
        report = dataclasses.replace(report, notes=tuple(both) if args.pack else list(both))
    print(report)
    if notes and args.moe:  # a MoE report has no notes of its own
        print("\n".join(f"note: {n}" for n in notes))
    return 0 if report.passed else 1

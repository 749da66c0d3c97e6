"""The demo from top to bottom: load, read the corpus, train every arm, report, plot."""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import textwrap
from pathlib import Path

import torch

from fullbatch._demo._corpus import make_batches, read_corpus
from fullbatch._demo._experiment import Record, make_optimizer_factory, run_arms
from fullbatch._demo._model import LoadedModel, load_local, tiny_llama
from fullbatch._demo._plot import plot
from fullbatch._demo._report import judge, table_header, table_row, verdict_text, write_csv

__all__ = ["TOLERANCE", "main"]

# Largest shadow-gradient error that counts as "the full-batch gradient": about 100x the
# rounding of one float32 gradient. Everything runs in float32: Hugging Face's Llama computes
# RMSNorm and rotary embeddings in float32 even in a float64 model, so float64 would not be
# float64 (its gradients differ by ~5e-8 when the loss is merely rescaled).
TOLERANCE = 1e-5
DTYPE = torch.float32
_DEFAULT_LR = {"adamw": 3e-3, "sgd": 1e-2}


def _fail(message: str) -> int:
    print(f"fullbatch demo: error: {message}", file=sys.stderr)
    return 2


def _load(args: argparse.Namespace) -> LoadedModel:
    if args.model is None:
        return tiny_llama(seed=args.seed, max_length=args.max_length, dtype=DTYPE)
    return load_local(args.model, max_length=args.max_length, dtype=DTYPE)


def main(args: argparse.Namespace) -> int:
    """Run the demo described by the parsed options; returns the exit status."""
    from tqdm import tqdm

    optimizer = args.optimizer or ("adamw" if args.model is None else "sgd")
    lr = args.lr if args.lr is not None else _DEFAULT_LR[optimizer]
    sizes = args.micro_batch_sizes
    out = Path(args.out)
    torch.set_num_threads(args.threads)
    try:
        device = torch.device(args.device)
        torch.empty(0, device=device)  # an unavailable device fails here, not mid-run
    except (AssertionError, RuntimeError) as exc:
        return _fail(f"--device {args.device!r} is not usable here ({exc}); try --device cpu")
    try:
        out.mkdir(parents=True, exist_ok=True)
        loaded = _load(args)
        corpus = read_corpus(args.steps * args.batch_size, seed=args.seed, encode=loaded.encode)
    except (OSError, RuntimeError, ValueError) as exc:
        return _fail(str(exc))
    batches = [
        {k: v.to(device) for k, v in batch.items()}
        for batch in make_batches(corpus.rows, batch_size=args.batch_size, pad_id=loaded.pad_id)
    ]
    lengths = [len(row) for row in corpus.rows]
    sizes_text = ", ".join(map(str, sizes))
    source = f"Python {platform.python_version()}, corpus {corpus.digest}"
    setup = (
        f"{loaded.description}; {optimizer} lr {lr:g}, float32; {len(batches)} steps of "
        f"{args.batch_size} rows; naive and fullbatch at micro-batch sizes {sizes_text}; "
        f"{torch.get_num_threads()} CPU thread(s) (--threads)."
    )
    data = (
        f"Data: {source} ({len(corpus.rows)} standard-library docstrings from {corpus.files} "
        f"files, {min(lengths)} to {max(lengths)} tokens a row, median "
        f"{statistics.median(lengths):g})."
    )
    intro = (
        f"fullbatch demo: {setup} {data} Each step, every recipe's gradient is also taken at "
        "the full-batch weights (its shadow gradient) and compared with the full-batch "
        "gradient there; drift = relative parameter distance to the full batch."
    )
    print("\n".join(textwrap.wrap(intro, 92, break_on_hyphens=False)), end="\n\n")
    print(table_header(sizes))
    records: list[Record] = []
    every = max(1, args.steps // 10)
    arms = run_arms(
        loaded.model.to(device),
        batches,
        micro_batch_sizes=sizes,
        optimizer_factory=make_optimizer_factory(optimizer, lr),
        seed=args.seed,
    )
    for step, step_records in enumerate(
        tqdm(
            arms,
            total=len(batches),
            desc="fullbatch demo",
            unit="step",
            file=sys.stderr,
            leave=False,
        ),
        start=1,
    ):
        records += step_records
        if step == 1 or step % every == 0 or step == len(batches):
            tqdm.write(table_row(step_records, sizes), file=sys.stdout)
    csv_path, png_path = out / "metrics.csv", out / "loss.png"
    write_csv(records, csv_path)
    plot(records, sizes, png_path, subtitle=f"{setup} {data}", tolerance=TOLERANCE)
    verdict = judge(records, TOLERANCE)
    print()
    print(verdict_text(verdict, f"Verdict ({source}):"))
    print(f"Wrote {csv_path} and {png_path}.")
    return verdict.exit_code

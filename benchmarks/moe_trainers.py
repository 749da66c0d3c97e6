"""The Hugging Face and TRL wings on a tiny MoE model: one step against the float64 full batch.

Tiny random Mixtral, Qwen3-MoE and OLMoE (``tests/_moe_cases.py``: float64, 2 layers, 4
experts, top-2, ``router_aux_loss_coef`` 0.25), one window of 8 right-padded rows with 1 to 7
real tokens, 2 rows per micro-batch: 4 micro-batches on one process, or 2 on each of 2 gloo
DDP ranks (spawned, a file store: no fixed port). The reference is written here: one forward
of the whole window (all 8 rows, both ranks'), the token-mean cross-entropy plus ``coef``
times the pooled load-balancing loss of the whole window (transformers' definition, in
float64). Each row is one optimizer step (SGD, lr 1, no clipping) of a trainer: its applied
gradient's error ``‖g - g*‖ / ‖g*‖``, the worst rank's. The stock ``transformers.Trainer``
runs twice: with ``num_items_in_batch`` (a model that takes loss kwargs, as these do: the
cross-entropy over the window's tokens, each micro-batch's aux term added undivided) and with
``loss/GA`` (``model_accepts_loss_kwargs`` off: each micro-batch's own mean loss over the
accumulation steps). ``trl.SFTTrainer`` with the 8 rows in one micro-batch is TRL's own full
batch: its distance to the reference is the float32 inside TRL's fused LM head; the step
without the aux term shows how much of the step the aux term is.

Run: ``PYTHONPATH=src python benchmarks/moe_trainers.py [--ranks 1 2]`` (about three minutes on
2 CPU cores).
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import pickle
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _moe_cases import (
    COEF,
    FAMILIES,
    VOCAB,
    aux64,
    forward,
    make_moe,
    moe_rows,
    rel_err,
    trainer_step,
)
from _trl_moe_cases import sft_step

LENGTHS = (7, 3, 5, 7, 2, 6, 4, 1)


def reference(model: Any) -> list[torch.Tensor]:
    """The full batch's gradient: CE summed over the window's targets plus ``n · coef · aux``,
    backpropagated once, divided by the ``n`` targets."""
    rows = moe_rows(LENGTHS, seed=1)
    out = forward(model, rows)
    labels = rows["labels"][:, 1:]
    n = int((labels != -100).sum())
    logits = out.logits[:, :-1].reshape(-1, VOCAB)
    ce = F.cross_entropy(logits, labels.reshape(-1), ignore_index=-100, reduction="sum")
    (ce + n * COEF * aux64(out.router_logits, rows["attention_mask"])).backward()
    return [torch.zeros_like(p) if p.grad is None else p.grad / n for p in model.parameters()]


def _loss_over_ga(trainer_cls: Any) -> Any:
    """``trainer_cls`` as the stock Trainer runs a model without loss kwargs: each micro-batch's
    own loss (its token mean + coef · its own aux) divided by the accumulation steps."""

    class LossOverGA(trainer_cls):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.model_accepts_loss_kwargs = False

    return LossOverGA


def steps(family: str, world: int) -> dict[str, list[torch.Tensor]]:
    """Every trainer's applied gradient on this rank (2 rows per micro-batch)."""
    import transformers
    from trl import SFTTrainer

    import fullbatch.hf
    import fullbatch.trl

    k = len(LENGTHS) // (2 * world)  # micro-batches per rank
    out: dict[str, list[torch.Tensor]] = {}
    hf = make_moe(family)
    hf.config.output_router_logits = True  # the model adds coef · aux to its own loss
    with tempfile.TemporaryDirectory() as tmp:
        out["Trainer (stock, num_items_in_batch)"] = trainer_step(
            copy.deepcopy(hf), transformers.Trainer, tmp, LENGTHS
        )
        out["Trainer (stock, loss/GA)"] = trainer_step(
            copy.deepcopy(hf), _loss_over_ga(transformers.Trainer), tmp, LENGTHS
        )
        out["ExactTrainer"] = trainer_step(
            copy.deepcopy(hf), fullbatch.hf.ExactTrainer, tmp, LENGTHS, loss="causal_lm"
        )
        # TRL turns output_router_logits on itself for the model's coef
        if world == 1:
            out["SFTTrainer, 1 micro-batch (TRL's full batch)"] = sft_step(
                make_moe(family), SFTTrainer, tmp, LENGTHS, 1, batch=8
            )[0]
        out["SFTTrainer (stock)"] = sft_step(make_moe(family), SFTTrainer, tmp, LENGTHS, k)[0]
        out["ExactSFTTrainer"] = sft_step(
            make_moe(family), fullbatch.trl.ExactSFTTrainer, tmp, LENGTHS, k
        )[0]
        if world == 1:
            out["ExactSFTTrainer, router_aux_loss_coef=0 (no aux term)"] = sft_step(
                make_moe(family),
                fullbatch.trl.ExactSFTTrainer,
                tmp,
                LENGTHS,
                k,
                router_aux_loss_coef=0.0,
            )[0]
    return out


def _quiet_steps(family: str, world: int) -> dict[str, list[torch.Tensor]]:
    """:func:`steps` without the trainers' log lines and warnings."""
    import transformers

    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        return steps(family, world)


def _rank(rank: int, world: int, store: str, out: Any) -> None:
    """One spawned DDP rank: every family's trainers; its updates go back pickled."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="1",  # never used: accelerate finds the process group initialized
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    found = {family: _quiet_steps(family, world) for family in FAMILIES}
    out.put((rank, pickle.dumps(found)))  # bytes: a tensor's shared memory dies with the rank
    dist.destroy_process_group()


def _ranks(world: int) -> list[dict[str, dict[str, list[torch.Tensor]]]]:
    """Every rank's updates, rank order."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank, args=(r, world, store, queue)) for r in range(world)]
        for p in procs:
            p.start()
        got = dict(queue.get(timeout=1200) for _ in procs)
        for p in procs:
            p.join(timeout=60)
    return [pickle.loads(got[r]) for r in range(world)]


def main() -> None:
    """``--ranks 1 2`` (default): which rank counts to run."""
    worlds = (
        [int(a) for a in sys.argv[sys.argv.index("--ranks") + 1 :]]
        if "--ranks" in sys.argv
        else [1, 2]
    )
    print("| model | ranks | trainer | step grad error |")
    print("|---|---|---|---|")
    for world in worlds:
        if world == 1:
            found = [{family: _quiet_steps(family, 1) for family in FAMILIES}]
        else:
            found = _ranks(world)
        for family in FAMILIES:
            want = reference(make_moe(family))
            for name in found[0][family]:
                worst = max(rel_err(rank[family][name], want) for rank in found)
                print(f"| {family} | {world} | {name} | {worst:.1e} |")


if __name__ == "__main__":
    main()

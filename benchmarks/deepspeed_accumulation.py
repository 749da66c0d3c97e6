"""DeepSpeed's own accumulation, measured: stock recipes and fullbatch's routes, every ZeRO stage.

Installs nothing: runs on whichever deepspeed (and transformers/accelerate, for those rows) is
present, on CPU (``DS_ACCELERATOR=cpu``, gloo, a FileStore: no port). For each engine — a raw
``deepspeed.initialize`` engine, the Hugging Face Trainer with a DeepSpeed config, Accelerate's
DeepSpeed plugin — at ZeRO stages 0-3 with and without ``offload_optimizer: cpu`` it trains one
window (``gradient_accumulation_steps=4``, SGD lr 1, float32) and prints the relative error of
the update DeepSpeed applied against a float64 full batch over the same rows computed here:

- ``stock: measured``: the usual recipe (raw/Accelerate: a per-micro-batch mean through
  ``engine.backward``/``accelerator.backward``, on 4 equal micro-batches of 2 fully labelled
  rows, where a mean of means equals the full batch: any error is DeepSpeed's own, and on 4
  uneven micro-batches of 1-4 rows with ``-100`` labels: the mean of means; Trainer:
  a causal LM that honours ``num_items_in_batch``, a BERT masked-LM head that does not, and the
  causal LM with ``gradient_clipping`` left out of the config, which DeepSpeed then fills with
  1.0 although ``max_grad_norm=0``);
- ``fullbatch route``: ``fullbatch.deepspeed.ExactEngine`` (raw; Accelerate: on the engine its
  DeepSpeed plugin prepared) or ``fullbatch.hf.ExactTrainer``, on the stock row's data and
  config: its error, or its refusal;
- ``probe``: ``fb.probe``'s verdict on the stock run itself (:func:`probe` wraps it; the probe
  leaves the run bitwise unchanged, so the measured column is the same with or without it):
  ``ok``, or the pattern it names, with its error and DeepSpeed's clip when it saw one, or why
  it could not check.

A verdict is ``ok`` when the error is below 1e-4 (float32 rounding measured here: ~5e-7).

    python benchmarks/deepspeed_accumulation.py [--ranks 1,2] [--engines raw,trainer,accelerate]
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import traceback
import warnings
from typing import Any

import torch

BAND = 1e-4
ROWS, K, IN, OUT = 2, 4, 6, 5
STAGES = [(0, False), (1, False), (1, True), (2, False), (2, True), (3, False), (3, True)]


def probe(objective: str) -> Probed:
    """``with probe(objective) as verdict:`` around a stock run; ``str(verdict)`` afterwards is
    the table's probe cell."""
    return Probed(objective)


class Probed:
    """``fb.probe`` around one stock run (see :func:`probe`)."""

    def __init__(self, objective: str) -> None:
        import fullbatch as fb

        self._probe = fb.probe(objective=objective, windows=1)

    def __enter__(self) -> Probed:
        self._probe.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._probe.__exit__(*exc)

    def __str__(self) -> str:
        report = self._probe.report
        if not report.windows:  # e.g. "unsupported: DeepSpeed clipped ... at ZeRO stage 0"
            why = report.problems[0] if report.problems else "nothing checked"
            return why.split(",")[0]
        window = report.windows[0]
        said = "ok" if window.ok else window.pattern
        clip = f", DeepSpeed's clip at {window.clip[0]:g} seen" if window.clip else ""
        return f"{said} ({window.error:.1e}{clip})"


def ds_config(stage: int, offload: bool, world: int, clip: Any = 0.0) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    out = {
        "train_micro_batch_size_per_gpu": ROWS,
        "gradient_accumulation_steps": K,
        "train_batch_size": ROWS * K * world,
        "gradient_clipping": clip,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
    }
    if clip is None:
        del out["gradient_clipping"]
    return out


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, 16), torch.nn.Tanh(), torch.nn.Linear(16, OUT))


def micro_batches(rank: int, uneven: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for k in range(K):
        g = torch.Generator().manual_seed(10 * rank + k)
        rows = 1 + (k + rank) % 4 if uneven else ROWS
        y = torch.randint(0, OUT, (rows,), generator=g)
        if uneven:
            y[torch.rand(rows, generator=g) < 0.3] = -100
        out.append((torch.randn(rows, IN, generator=g), y))
    return out


def full_batch_update(world: int, uneven: bool) -> list[torch.Tensor]:
    model = mlp().double()
    xs = [x for r in range(world) for x, _ in micro_batches(r, uneven)]
    ys = [y for r in range(world) for _, y in micro_batches(r, uneven)]
    torch.nn.functional.cross_entropy(model(torch.cat(xs).double()), torch.cat(ys)).backward()
    return [-p.grad for p in model.parameters()]  # SGD, lr 1


def rel(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    num = sum(float((g.double() - w.double()).pow(2).sum()) for g, w in zip(got, want, strict=True))
    return (num / sum(float(w.double().pow(2).sum()) for w in want)) ** 0.5


def full_params(module: torch.nn.Module) -> list[torch.Tensor]:
    from deepspeed.utils import safe_get_full_fp32_param

    out = []
    for p in module.parameters():
        full = safe_get_full_fp32_param(p)
        out.append((p if full is None else full).detach().double().clone())
    return out


def update_error(
    before: list[torch.Tensor], module: torch.nn.Module, want: list[torch.Tensor]
) -> float:
    return rel([a - b for a, b in zip(full_params(module), before, strict=False)], want)


# -- raw DeepSpeed and Accelerate's plugin --------------------------------------------------


def _engine(kind: str, stage: int, offload: bool, world: int) -> tuple[Any, Any]:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    config = ds_config(stage, offload, world)
    if kind == "raw":
        import deepspeed

        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
        return engine, None
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DeepSpeedPlugin

    AcceleratorState._reset_state(True)
    GradientState._reset_state()  # the Trainer rows' accumulation state is not this engine's
    accelerator = Accelerator(
        deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config), gradient_accumulation_steps=K
    )
    engine, _ = accelerator.prepare(model, opt)
    return engine, accelerator


def engine_row(kind: str, rank: int, world: int, stage: int, offload: bool) -> dict[str, Any]:
    """``{recipe: (stock error, the probe's verdict on it, fullbatch's error or refusal)}`` for
    a raw or Accelerate engine, on equal micro-batches and on uneven ones with ``-100`` labels."""
    out = {}
    for uneven, recipe in ((False, "mean loss, equal rows"), (True, "mean loss, uneven rows")):
        out[recipe] = (
            *_stock(kind, rank, world, stage, offload, uneven),
            _exact(kind, rank, world, stage, offload, uneven),
        )
    return out


def _stock(
    kind: str, rank: int, world: int, stage: int, offload: bool, uneven: bool
) -> tuple[float, str]:
    """A per-micro-batch mean through ``engine.backward`` / ``accelerator.backward``: its
    error, and the probe's verdict on it."""
    engine, accelerator = _engine(kind, stage, offload, world)
    before = full_params(engine.module)
    with probe("sample") as verdict:  # the labels: the loop's y beside the model's input
        for i, (x, y) in enumerate(micro_batches(rank, uneven)):
            loss = torch.nn.functional.cross_entropy(engine(x), y)
            if accelerator is None:
                engine.set_gradient_accumulation_boundary(i == K - 1)
                engine.backward(loss)
            else:
                with accelerator.accumulate(engine):
                    accelerator.backward(loss)
        if accelerator is None:
            engine.step()
    return update_error(before, engine.module, full_batch_update(world, uneven)), str(verdict)


def _exact(kind: str, rank: int, world: int, stage: int, offload: bool, uneven: bool) -> Any:
    """``fullbatch.deepspeed.ExactEngine`` on the same engine: its error, or its refusal."""
    import fullbatch as fb
    from fullbatch.deepspeed import ExactEngine

    engine, _ = _engine(kind, stage, offload, world)
    try:
        exact = ExactEngine(engine, count=lambda m: int((m[1] != -100).sum()))
    except ValueError as exc:
        return _refused(exc)
    before = full_params(engine.module)
    for window in exact.windows(micro_batches(rank, uneven)):
        for x, y in window:
            window.backward(*fb.cross_entropy_sum(engine(x), y))
        window.step()
    return update_error(before, engine.module, full_batch_update(world, uneven))


def _refused(exc: Exception) -> str:
    """The refusal's reason, without its fix."""
    why = str(exc).split(" exact: ", 1)[-1]
    why = why.split("; ")[0].split(" (DeepSpeed #")[0]
    return "refused: " + why


# -- the Hugging Face Trainer ---------------------------------------------------------------


def _lm_rows(n: int) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    return [
        {"input_ids": torch.randint(3, 60, (4 + (i * 5) % 9,), generator=g).tolist()}
        for i in range(n)
    ]


def _collate(kind: str) -> Any:
    def collate(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        width = max(len(r["input_ids"]) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
            mask[i, : len(r["input_ids"])] = 1
        labels = ids.masked_fill(mask == 0, -100)
        if kind == "masked_lm":  # every third position a target
            labels = labels.masked_fill(torch.arange(width).expand_as(labels) % 3 != 0, -100)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    return collate


def _hf_model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "causal_lm":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(
            LlamaConfig(
                vocab_size=64,
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=2,
                pad_token_id=0,
                initializer_range=0.2,  # a full-batch gradient norm of 1.4: DeepSpeed's 1.0 clips
            )
        )
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(
        BertConfig(
            vocab_size=64,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            pad_token_id=0,
        )
    )


def _hf_reference(kind: str, rows: list[dict[str, Any]]) -> list[torch.Tensor]:
    model = _hf_model(kind).double()
    batch = _collate(kind)(rows)
    labels = batch.pop("labels")
    logits = model(**batch).logits
    if kind == "causal_lm":
        logits, labels = logits[:, :-1], labels[:, 1:]
    torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    ).backward()
    return [-0.1 * p.grad for p in model.parameters()]  # SGD, lr 0.1


def trainer_error(kind: str, stage: int, offload: bool, world: int, exact: bool, clip: Any) -> Any:
    from transformers import Trainer, TrainingArguments

    rows = _lm_rows(8 * world)
    model = _hf_model(kind)
    before = [p.detach().double().clone() for p in model.parameters()]
    config = ds_config(stage, offload, world, clip)
    config.update(
        train_micro_batch_size_per_gpu="auto",
        gradient_accumulation_steps="auto",
        train_batch_size="auto",
    )
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            tmp,
            per_device_train_batch_size=ROWS,
            gradient_accumulation_steps=K,
            learning_rate=0.1,
            optim="sgd",
            lr_scheduler_type="constant",
            max_grad_norm=0.0,
            num_train_epochs=1,
            max_steps=1,
            train_sampling_strategy="sequential",
            remove_unused_columns=False,
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            disable_tqdm=True,
            deepspeed=config,
            seed=0,
        )
        kwargs = dict(model=model, args=args, train_dataset=rows, data_collator=_collate(kind))
        objective = "token" if kind == "masked_lm" else kind  # fullbatch.hf.LOSS_KINDS
        try:
            if exact:
                from fullbatch.hf import ExactTrainer

                trainer: Any = ExactTrainer(**kwargs, loss=objective)
            else:
                trainer = Trainer(**kwargs)
        except ValueError as exc:
            return _refused(exc), ""
        with probe(objective) as verdict:
            trainer.train()
    # rank r read rows r*2.., r*2+world*2.. (DistributedSampler, sequential): gather them all
    got = [a - b for a, b in zip(full_params(trainer.model_wrapped.module), before, strict=False)]
    return rel(got, _hf_reference(kind, rows)), str(verdict)


def trainer_row(rank: int, world: int, stage: int, offload: bool) -> dict[str, Any]:
    """``{recipe: (stock Trainer's error, the probe's verdict on it, ExactTrainer's error or
    refusal)}``, same config."""

    def both(kind: str, clip: Any) -> tuple[Any, Any, Any]:
        stock, verdict = trainer_error(kind, stage, offload, world, False, clip)
        return stock, verdict, trainer_error(kind, stage, offload, world, True, clip)[0]

    return {
        "causal LM": both("causal_lm", "auto"),
        "BERT MLM": both("masked_lm", "auto"),
        "causal LM, no clip key": both("causal_lm", None),
    }


# -- ranks ----------------------------------------------------------------------------------


def _rank(rank: int, world: int, store: str, engines: list[str], out: Any) -> None:
    os.environ.update(
        DS_ACCELERATOR="cpu",
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="1",
        OMP_NUM_THREADS="1",
    )
    # one build folder per Python environment for DeepSpeed's deepspeed_shm_comm extension
    # (two deepspeed versions sharing one rebuild it; a killed build leaves a lock forever)
    key = hashlib.sha1(sys.prefix.encode()).hexdigest()[:10]
    default = os.path.join(
        os.path.expanduser("~"), ".cache", "torch_extensions", f"fullbatch-{key}"
    )
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", default)
    import logging

    import torch.distributed as dist

    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    rows = []
    for engine in engines:
        for stage, offload in STAGES:
            try:
                if engine == "trainer":
                    result = trainer_row(rank, world, stage, offload)
                else:
                    result = engine_row(engine, rank, world, stage, offload)
            except Exception as exc:  # a row that cannot run says why
                traceback.print_exc()
                result = {"error": (f"{type(exc).__name__}: {str(exc)[:60]}", "", "")}
            rows.append((engine, stage, offload, result))
    if rank == 0:
        out.put(rows)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.1e} {'ok' if value < BAND else 'WRONG'}"
    return str(value)


def _run(world: int, engines: list[str]) -> list[Any]:
    """Every row on ``world`` ranks (spawned; rank 0 sends the rows back)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "s")
        procs = [
            ctx.Process(target=_rank, args=(r, world, store, engines, out)) for r in range(world)
        ]
        for p in procs:
            p.start()
        rows = None
        while rows is None:  # a rank that died (a gloo abort) sends nothing: say so, never hang
            try:
                rows = out.get(timeout=5)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    for p in procs:
                        p.kill()
                    raise RuntimeError(
                        f"rank(s) {dead} of {world} died (exit codes "
                        f"{[procs[r].exitcode for r in dead]}); their stderr says why"
                    ) from None
        for p in procs:
            p.join()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", default="1,2", help="rank counts, e.g. 1 or 1,2")
    parser.add_argument("--engines", default="raw,trainer,accelerate")
    args = parser.parse_args()
    import deepspeed

    engines = [e for e in args.engines.split(",") if e]
    worlds = [int(w) for w in args.ranks.split(",")]
    runs = [_run(world, engines) for world in worlds]
    print(
        f"deepspeed {deepspeed.__version__}, torch {torch.__version__}, "
        f"gradient_accumulation_steps={K} per rank, float32 vs a float64 full batch over every "
        f"rank's rows; ok < {BAND:g}"
    )
    ranks = [f"{w} rank{'s' if w > 1 else ''}" for w in worlds]

    def columns(name: str) -> str:
        return " | ".join(f"{name}, {r}" for r in ranks)

    print(f"| engine | stage | offload | recipe | {columns('stock')} | {columns('probe')} | "
          f"{columns('fullbatch')} |")  # fmt: skip
    print("|---" * (4 + 3 * len(worlds)) + "|")
    for index, (engine, stage, offload, _) in enumerate(runs[0]):
        recipes = dict.fromkeys(r for run in runs for r in run[index][3])
        for recipe in recipes:
            cells = [run[index][3].get(recipe, ("-", "-", "-")) for run in runs]  # per world
            where = f"| {engine} | {stage} | {'cpu' if offload else '-'} | {recipe} |"
            stock = " | ".join(_cell(c[0]) for c in cells)
            verdict = " | ".join(str(c[1]) for c in cells)
            route = " | ".join(_cell(c[2]) for c in cells)
            print(f"{where} {stock} | {verdict} | {route} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()

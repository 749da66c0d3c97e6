"""Rank functions for the length-aware splitting tests under DDP and FSDP2 (2 gloo ranks), and
the float64 full-batch reference on the union of every rank's rows."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import fullbatch as fb

VOCAB, DIM, WIDTH = 17, 8, 16
ROWS = (10, 5)  # rows per window on rank 0 and rank 1: the ranks get different counts


class CausalLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mix = nn.Linear(DIM, DIM)
        self.out = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        return self.out(h + torch.tanh(self.mix(h)))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return CausalLM().double()


def rank_window(rank: int, index: int) -> dict[str, torch.Tensor]:
    """Window ``index`` of ``rank``: right-padded to WIDTH, rows of 1..WIDTH-2 tokens."""
    g = torch.Generator().manual_seed(1000 * rank + index)
    rows = ROWS[rank]
    lengths = torch.randint(1, WIDTH - 1, (rows,), generator=g)
    ids = torch.randint(1, VOCAB, (rows, WIDTH), generator=g)
    mask = (torch.arange(WIDTH) < lengths[:, None]).long()
    ids = ids * mask
    labels = ids.masked_fill(mask == 0, -100)
    labels[torch.rand(rows, WIDTH, generator=g) < 0.2] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def _full(model: nn.Module) -> torch.Tensor:
    parts = []
    for p in model.parameters():
        t = p.detach()
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        parts.append(t.reshape(-1))
    return torch.cat(parts)


def train(rank: int, world: int, wrapper: str, options: dict[str, Any], windows: int) -> dict:
    """fullbatch with length-aware micro-batches; parameters and micro-batch counts per step."""
    model = make_model()
    if wrapper == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.mix)
        model = fully_shard(model)
    opt = _optimizer(model.parameters())
    loader = [rank_window(rank, w) for w in range(windows)]
    out: dict[str, list[Any]] = {"params": [], "real": [], "padding": []}
    with fb.Accumulator(model, opt, **options) as acc:
        for window in acc.windows(loader):
            real = padding = 0
            for micro in window:
                padding += window.is_padding
                real += not window.is_padding
                window.backward(*fb.causal_lm_loss(model(micro["input_ids"]), micro["labels"]))
            assert not window.step().skipped
            out["params"].append(_full(model))
            out["real"].append(real)
            out["padding"].append(padding)
    return out


def reference(windows: int) -> list[torch.Tensor]:
    """Plain PyTorch, float64: one mean loss over both ranks' rows, one backward, per window."""
    model = make_model()
    opt = _optimizer(model.parameters())
    out = []
    for w in range(windows):
        ids = torch.cat([rank_window(r, w)["input_ids"] for r in range(2)])
        labels = torch.cat([rank_window(r, w)["labels"] for r in range(2)])
        logits = model(ids)
        loss = F.cross_entropy(
            logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(_full(model))
    return out


_COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "_broadcast_coalesced",
)


class BufferedLM(CausalLM):
    """With a buffer, so that DDP broadcasts buffers in its forwards (a collective)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(()))


def train_packed(rank: int, world: int, wrapper: str, windows: int) -> dict[str, Any]:
    """pack=True three ways in one process group: the plain loop, ``window.run`` (the packing
    check on the first window) and ``window.run`` with ``verify_pack=False``; parameters after
    every step, micro-batch counts, collectives issued (wrapped torch.distributed functions and,
    under DDP, gradient buckets through a comm hook) and warnings."""
    import warnings

    import torch.distributed as dist

    calls = {"n": 0}

    def counted(real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls["n"] += 1
            return real(*args, **kwargs)

        return call

    for name in _COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, counted(getattr(dist, name)))
    out: dict[str, Any] = {}
    for mode in ("loop", "run", "unchecked"):
        torch.manual_seed(0)
        model: nn.Module = BufferedLM().double()
        if wrapper == "ddp":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            model = nn.parallel.DistributedDataParallel(model)

            def hook(state, bucket):  # type: ignore[no-untyped-def]  (DDP checks annotations)
                calls["n"] += 1
                return default_hooks.allreduce_hook(state, bucket)

            model.register_comm_hook(None, hook)
        else:
            from torch.distributed.fsdp import fully_shard

            fully_shard(model.mix)
            model = fully_shard(model)
        opt = _optimizer(model.parameters())
        loader = [rank_window(rank, w) for w in range(windows)]
        options = {"micro_batch_tokens": 30, "pack": True, "verify_pack": mode != "unchecked"}
        res: dict[str, Any] = {"params": [], "real": [], "padding": []}
        calls["n"] = 0

        def loss(micro: Any, model: nn.Module = model) -> Any:
            return fb.causal_lm_loss(model(micro["input_ids"]), micro["labels"])

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with fb.Accumulator(model, opt, **options) as acc:
                for window in acc.windows(loader):
                    real = padding = 0
                    if mode == "loop":
                        for micro in window:
                            padding += window.is_padding
                            real += not window.is_padding
                            window.backward(*loss(micro))
                        assert not window.step().skipped
                    else:
                        stats = window.run(loss)
                        real = stats.micro_batches
                    res["params"].append(_full(model))
                    res["real"].append(real)
                    res["padding"].append(padding)
        check = acc._engine.pack_check
        res["report"] = None if check is None or check.report is None else check.report.passed
        res["collectives"] = calls["n"]
        # torch's own FSDP2 notes (view tensors returned) are not fullbatch's
        res["warnings"] = [
            str(w.message)[:60] for w in caught if not str(w.message).startswith("FSDP2-wrapped")
        ]
        out[mode] = res
    return out

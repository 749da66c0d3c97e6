"""torch.compile through ``fb.Accumulator``: what dynamo does equals a hand-written loop's.

A compiled model trained for a few windows: no graph break, the same graphs and no recompile
beyond what the hand loop on the same micro-batches needs (fixed shapes: none; the shapes
``sort_rows`` trims to: the same dynamic-shape recompile). Under DDP (2 gloo ranks,
``torch.compile(ddp_model)``), fullbatch sets ``require_backward_grad_sync`` per micro-batch
and the hand loop uses ``no_sync()``: neither recompiles, and fullbatch adds no graph break to
the ones DDP's own forward has. The loss helpers compile with the model without a graph break
(their label check is a device assertion inside ``torch.compile``). The ``aot_eager``
backend: guards, graph breaks and recompiles are decided by dynamo, whatever the backend; it
compiles in seconds.

With ``pad_to_multiple_of`` (buckets), a model compiled with static shapes
(``dynamic=False``, what CUDA graphs and the fastest kernels want) compiles once per bucket and
never again: one graph per distinct (rows, width), where exact widths need one per width.
"""

from __future__ import annotations

import pytest
import torch

import _compile_cases as cases
import fullbatch as fb
from _dist import run_ranks, values
from _sync_cases import TinyLM, lm_data

pytestmark = pytest.mark.timeout(240)
K = 3


def _compiled(model: torch.nn.Module) -> torch.nn.Module:
    return torch.compile(model, backend="aot_eager")  # type: ignore[return-value]


def test_fixed_shapes_compile_once_without_graph_breaks() -> None:
    data = lm_data(K * 3)

    def ours() -> None:
        torch.manual_seed(0)
        model = TinyLM()
        cases.with_fullbatch(model, _compiled(model), data, micro_batches=K)

    def hand() -> None:
        torch.manual_seed(0)
        model = TinyLM()
        cases.hand_loop(model, _compiled(model), [data[w * K : (w + 1) * K] for w in range(3)])

    mine, theirs = cases.dynamo_counts(ours), cases.dynamo_counts(hand)
    assert mine == theirs == {"graph_breaks": [], "recompiles": [], "graphs": 1}


def test_trimmed_shapes_recompile_as_the_hand_loop_does() -> None:
    windows = [lm_data(1, rows=6, length=8, seed=w)[0] for w in range(3)]
    seen: list[list[dict[str, torch.Tensor]]] = []

    def ours() -> None:
        torch.manual_seed(0)
        model = TinyLM()
        options = {"micro_batch_size": 2, "sort_rows": True}
        cases.with_fullbatch(model, _compiled(model), windows, seen, **options)

    def hand() -> None:  # the same micro-batches, in the same order
        torch.manual_seed(0)
        model = TinyLM()
        cases.hand_loop(model, _compiled(model), seen)

    mine = cases.dynamo_counts(ours)
    assert len({m["input_ids"].shape for w in seen for m in w}) > 1  # shapes do vary
    theirs = cases.dynamo_counts(hand)
    assert mine["graph_breaks"] == theirs["graph_breaks"] == []
    assert len(mine["recompiles"]) == len(theirs["recompiles"]), (mine, theirs)
    assert mine["graphs"] == theirs["graphs"]


def _bucket_windows() -> list[dict[str, torch.Tensor]]:
    """2 windows of 8 rows padded to 24 columns, rows of 2..24 tokens: many exact widths."""
    return [lm_data(1, rows=8, length=24, seed=w)[0] for w in range(2)]


@pytest.mark.parametrize(
    "options",
    [
        {"micro_batch_size": 2, "sort_rows": True},
        {"micro_batch_tokens": 48},
    ],
    ids=["sort_rows", "micro_batch_tokens"],
)
def test_static_shapes_compile_once_per_bucket(options: dict) -> None:
    """dynamic=False: a graph per distinct (rows, width); buckets keep them few."""

    def run(multiple: int | None) -> tuple[dict, set[tuple[int, ...]]]:
        seen: list[list[dict[str, torch.Tensor]]] = []

        def ours() -> None:
            torch.manual_seed(0)
            model = TinyLM()
            compiled = torch.compile(model, backend="aot_eager", dynamic=False)
            cases.with_fullbatch(model, compiled, _bucket_windows(), seen,
                                 pad_to_multiple_of=multiple, **options)  # fmt: skip

        with torch._dynamo.config.patch(recompile_limit=64):  # count them all, no fallback
            counted = cases.dynamo_counts(ours)
        return counted, {tuple(m["input_ids"].shape) for w in seen for m in w}

    bucketed, buckets = run(8)
    exact, widths = run(None)
    assert {w for _, w in buckets} <= {8, 16, 24}
    # one compile per bucket: the first is a compile, every other one a recompile
    assert len(bucketed["recompiles"]) == len(buckets) - 1 == bucketed["graphs"] - 1
    assert len(exact["recompiles"]) == len(widths) - 1 > len(buckets)
    assert bucketed["graph_breaks"] == exact["graph_breaks"] == []


def test_default_dynamic_shapes_recompile_once_with_or_without_buckets() -> None:
    """dynamo's default (automatic dynamic shapes): the first new width recompiles with that
    dimension dynamic; later shapes reuse that graph."""
    for multiple in (None, 8):

        def ours(multiple: int | None = multiple) -> None:
            torch.manual_seed(0)
            model = TinyLM()
            cases.with_fullbatch(model, _compiled(model), _bucket_windows(), micro_batch_size=2,
                                 sort_rows=True, pad_to_multiple_of=multiple)  # fmt: skip

        counted = cases.dynamo_counts(ours)
        assert len(counted["recompiles"]) <= 1 and counted["graph_breaks"] == [], counted


def test_ddp_sync_toggling_does_not_recompile() -> None:
    results = values(run_ranks(cases.ddp_compiled, 2, K, 3, deadline=200))
    for rank, counted in enumerate(results):
        mine, theirs = counted["fullbatch"], counted["hand"]
        assert mine["recompiles"] == theirs["recompiles"] == [], (rank, counted)
        assert set(mine["graph_breaks"]) <= set(theirs["graph_breaks"]), (rank, counted)
        assert mine["graphs"] == theirs["graphs"], (rank, counted)


def test_a_compiled_loss_helper_has_no_graph_break() -> None:
    """``fb.causal_lm_loss`` inside the compiled function: its label check is a device
    assertion there (a host ``bool()`` would break the graph on CPU), and still refuses."""
    data = lm_data(K * 2)

    def ours() -> None:
        torch.manual_seed(0)
        model = TinyLM()
        step = torch.compile(
            lambda ids, labels: fb.causal_lm_loss(model(ids), labels), backend="aot_eager"
        )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with fb.Accumulator(model, opt, micro_batches=K) as acc:
            for window in acc.windows(data):
                for m in window:
                    window.backward(*step(m["input_ids"], m["labels"]))
                window.step()
        labels = data[0]["labels"].clone()
        labels[0, 3] = -1
        with pytest.raises(RuntimeError, match="negative values other than ignore_index"):
            step(data[0]["input_ids"], labels)

    assert cases.dynamo_counts(ours) == {"graph_breaks": [], "recompiles": [], "graphs": 1}

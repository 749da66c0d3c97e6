"""Splitting one loader item into micro-batches of rows (``micro_batch_size``)."""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import pytest
import torch

import fullbatch as fb
from conftest import class_batch, fb_loss, make_mlp
from fullbatch._base._split import count_rows, split_rows


class Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor
    tag: str


def rows_of(size: int, total: int) -> list[int]:
    return [min(size, total - i) for i in range(0, total, size)]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 8, 100])
def test_dict_rows_split_and_other_leaves_shared(size: int) -> None:
    zero_dim = torch.tensor(3.5)
    batch = {
        "x": torch.randn(7, 3),
        "y": torch.arange(7),
        "scale": zero_dim,
        "name": "ws",
        "n": 4,
        "cfg": None,
    }
    micros = split_rows(batch, size)
    assert [m["x"].shape[0] for m in micros] == rows_of(size, 7)
    for m in micros:
        assert type(m) is dict and list(m) == list(batch)
        assert m["scale"] is zero_dim  # 0-dim tensors unchanged, to every micro-batch
        assert m["name"] == "ws" and m["n"] == 4 and m["cfg"] is None
    torch.testing.assert_close(torch.cat([m["x"] for m in micros]), batch["x"])
    assert torch.equal(torch.cat([m["y"] for m in micros]), batch["y"])
    # views, not copies
    assert all(
        m["x"].untyped_storage().data_ptr() == batch["x"].untyped_storage().data_ptr()
        for m in micros
    )


def test_tuple_list_nested_and_named_tuple() -> None:
    x, y = torch.randn(5, 2), torch.arange(5)
    nested = {"inputs": (x, [y, "keep"]), "meta": {"w": torch.ones(5), "k": torch.tensor(1)}}
    micros = split_rows(nested, 2)
    assert len(micros) == 3
    inputs = micros[2]["inputs"]
    assert isinstance(inputs, tuple) and isinstance(inputs[1], list)
    assert torch.equal(inputs[0], x[4:]) and torch.equal(inputs[1][0], y[4:])
    assert inputs[1][1] == "keep"
    assert torch.equal(micros[1]["meta"]["w"], torch.ones(2))
    assert micros[1]["meta"]["k"] is nested["meta"]["k"]

    pair = Pair(x, y, "train")
    parts = split_rows(pair, 3)
    assert all(type(p) is Pair for p in parts)
    assert [p.x.shape[0] for p in parts] == [3, 2]
    assert parts[1].tag == "train" and torch.equal(parts[1].y, y[3:])

    as_tuple = split_rows((x, y), 4)
    assert all(type(p) is tuple for p in as_tuple)
    as_list = split_rows([x, y], 4)
    assert all(type(p) is list for p in as_list)


def test_mapping_types_are_kept() -> None:
    batch = OrderedDict(x=torch.randn(4, 2), y=torch.arange(4))
    parts = split_rows(batch, 3)
    assert all(type(p) is OrderedDict for p in parts)
    assert list(parts[0]) == ["x", "y"]


def test_hf_batch_encoding_is_split() -> None:
    transformers = pytest.importorskip("transformers")
    enc = transformers.BatchEncoding(
        {"input_ids": torch.ones(3, 4, dtype=torch.long), "attention_mask": torch.ones(3, 4)}
    )
    parts = split_rows(enc, 2)
    assert [p["input_ids"].shape[0] for p in parts] == [2, 1]


@pytest.mark.parametrize(
    "batch,names",
    [
        ({"x": torch.randn(5, 2), "y": torch.zeros(4)}, ["batch['x']", "batch['y']", "(4,)"]),
        ({"a": {"b": torch.zeros(3)}, "c": torch.zeros(2, 3)}, ["batch['a']['b']", "batch['c']"]),
        ((torch.zeros(3), [torch.zeros(3), torch.zeros(1, 3)]), ["batch[0]", "batch[1][1]"]),
        (Pair(torch.zeros(3), torch.zeros(2), "t"), ["batch[0]", "batch[1]"]),
    ],
)
def test_mismatch_names_the_keys(batch, names: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        split_rows(batch, 2)
    message = str(info.value)
    for name in names:
        assert name in message, (name, message)
    assert "micro_batches=K" in message  # the fix for packed sequences


@pytest.mark.parametrize("batch", [{"a": 1}, [torch.tensor(1.0), "s"], torch.tensor(2.0), 3])
def test_nothing_to_split(batch) -> None:
    with pytest.raises(ValueError, match="no tensor with a first dimension"):
        count_rows(batch)


def test_zero_dim_tensors_do_not_set_the_row_count() -> None:
    assert count_rows({"s": torch.tensor(1.0), "x": torch.zeros(6, 2)}) == 6
    assert split_rows({"x": torch.zeros(0, 2)}, 3) == []


def test_accumulator_yields_the_split_micro_batches() -> None:
    batch = class_batch(7, seed=3)
    pair = Pair(batch["x"], batch["y"], "tag")
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    with fb.Accumulator(model, opt, micro_batch_size=3) as acc:
        for window in acc.windows([pair]):
            assert len(window) == 3
            for micro in window:
                assert type(micro) is Pair and micro.tag == "tag"
                seen.append(micro.x)
                window.backward(*fb_loss(model, {"x": micro.x, "y": micro.y}))
            stats = window.step()
    assert [s.shape[0] for s in seen] == [3, 3, 1]
    assert torch.equal(torch.cat(seen), batch["x"])
    assert stats.micro_batches == 3 and stats.count == 7

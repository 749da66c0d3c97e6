"""``fb.row_windows``: windows of rows over in-memory batches, cut or joined across batches."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fullbatch as fb


def _batch(start: int, rows: int, width: int) -> dict:
    ids = torch.arange(start, start + rows)[:, None].repeat(1, width) + 1
    return {
        "ids": ids,
        "adv": torch.arange(start, start + rows).double(),
        "text": [str(i) for i in range(start, start + rows)],
        "gen": start,
    }


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 7), min_size=1, max_size=5), rows=st.integers(1, 9))
def test_windows_keep_every_row_in_order(sizes: list[int], rows: int) -> None:
    batches, start = [], 0
    for size in sizes:
        batches.append(_batch(start, size, width=3))
        start += size
    windows = list(fb.row_windows(batches, rows=rows))
    assert [len(w["adv"]) for w in windows[:-1]] == [rows] * (len(windows) - 1)
    assert 1 <= len(windows[-1]["adv"]) <= rows
    assert torch.cat([w["adv"] for w in windows]).tolist() == list(range(start))
    assert [t for w in windows for t in w["text"]] == [str(i) for i in range(start)]
    assert torch.equal(
        torch.cat([w["ids"] for w in windows]), torch.cat([b["ids"] for b in batches])
    )


def test_a_window_spanning_batches_pads_their_widths_and_keeps_its_first_batch_values() -> None:
    first, second = _batch(0, 3, width=2), _batch(3, 3, width=4)
    second["prompt"] = torch.tensor([[7], [8], [9]])
    first["prompt"] = torch.tensor([[4, 5], [5, 5], [6, 5]])
    windows = list(
        fb.row_windows([first, second], rows=4, pad={"ids": -1, "prompt": 0}, left={"prompt"})
    )
    assert windows[0]["ids"].tolist() == [
        [1, 1, -1, -1],
        [2, 2, -1, -1],
        [3, 3, -1, -1],
        [4, 4, 4, 4],
    ]
    assert windows[0]["prompt"].tolist() == [[4, 5], [5, 5], [6, 5], [0, 7]]
    assert windows[0]["gen"] == 0 and windows[1]["gen"] == 3
    assert windows[1]["ids"].tolist() == [[5, 5, 5, 5], [6, 6, 6, 6]]


@pytest.mark.parametrize("rows", [0, -2, 2.0, True, None])
def test_rows_must_be_a_positive_integer(rows: object) -> None:
    with pytest.raises(ValueError, match=f"rows must be a positive integer.*got {rows!r}"):
        list(fb.row_windows([_batch(0, 2, 2)], rows=rows))  # type: ignore[arg-type]


def test_bad_batches_raise_naming_the_keys() -> None:
    bad = {"ids": torch.zeros(3, 2), "adv": torch.zeros(2)}
    with pytest.raises(ValueError, match="'ids' has 3 rows but 'adv' has 2"):
        list(fb.row_windows([bad], rows=2))
    other = {"x": torch.zeros(1, 2)}
    with pytest.raises(ValueError, match="keys differ"):
        list(fb.row_windows([_batch(0, 1, 2), other], rows=2))
    with pytest.raises(ValueError, match="no rows"):
        list(fb.row_windows([{"gen": 1}], rows=2))
    with pytest.raises(ValueError, match="dicts of rows-first tensors"):
        list(fb.row_windows([torch.zeros(2, 2)], rows=2))  # type: ignore[list-item]

"""Host synchronizations per window, counted on a fake device that CPU tensors cannot fool.

A hand-written loop on a GPU (summed losses over an up-front count, ``clip_grad_norm_``, a
foreach AdamW) never waits for the device. fullbatch waits once per window: ``window.step()``
reads the numbers its verdict needs (loss sum, count, flags, squared norm, the GradScaler's
scale) in one ``tolist()``. Nothing per micro-batch: counts stay device tensors, the loss
helpers check labels with an asynchronous assertion. ``counts=`` adds one read per window
(``window.totals`` are numbers before the first backward); splitting by length
(``sort_rows``, ``micro_batch_tokens``, ``pack``) adds one read of the lengths, which the
grouping needs on the host, and one non-blocking copy of the row order per window (the first
two windows also read whether the trimmed columns held only padding: once per window).

The harness (``tests/_sync_cases.py``) puts the model and the data "on the GPU": tensors that
report ``cuda:0`` so fullbatch and torch take their GPU branches, and whose reads it counts.
The first tests show it counts what a GPU waits for and nothing else. Windows after the first
are the steady state: the first window also runs the one-time label checks
(``fullbatch._engine._labels``), which read the first two micro-batches.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import fullbatch as fb
from _sync_cases import DEVICE, HostSyncs, TinyLM, count_windows, lm_data

K, WINDOWS = 3, 4


def _lm_loss(model: nn.Module) -> Any:
    return lambda m: fb.causal_lm_loss(model(m["input_ids"]), m["labels"])


def _train(
    loader: Any = None, *, scaler: bool = False, share: str | None = None, **options: Any
) -> list[dict[str, Any]]:
    h = HostSyncs()
    torch.manual_seed(0)
    model = TinyLM()
    with h:
        h.to_device(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if not {"micro_batch_size", "micro_batch_tokens"} & set(options):
            options["micro_batches"] = K
        acc = fb.Accumulator(
            model,
            opt,
            max_grad_norm=1.0,
            scaler=torch.amp.GradScaler("cpu") if scaler else None,
            **options,
        )
        data = h.to_device(lm_data(K * WINDOWS) if loader is None else loader)
        return count_windows(h, acc, data, _lm_loss(model), share=share)


def _steady(windows: list[dict[str, Any]], after: int = 1) -> list[dict[str, Any]]:
    assert len(windows) == WINDOWS
    return windows[after:]


# -- the harness counts what a GPU waits for, and nothing else ---------------------------------


def test_a_hand_written_loop_waits_for_nothing() -> None:
    h = HostSyncs()
    torch.manual_seed(0)
    model = TinyLM()
    with h:
        h.to_device(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # foreach; host step counters
        data = h.to_device(lm_data(K * 2))
        for w in range(2):
            window = data[w * K : (w + 1) * K]
            n = sum(fb.count_tokens(m["labels"]) for m in window)
            for m in window:
                loss_sum, _ = fb.causal_lm_loss(model(m["input_ids"]), m["labels"])
                (loss_sum / n).backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        state = opt.state[model.head.weight]
        assert model.head.weight.device == DEVICE and state["exp_avg"].is_cuda
        assert not state["step"].is_cuda  # AdamW's step counter lives on the host, as on a GPU
    assert h.count("read") == 0, h.show()
    assert h.count("h2d") == 0, h.show("h2d")


def test_a_loss_item_per_micro_batch_is_counted_per_micro_batch() -> None:
    h = HostSyncs()
    model = TinyLM()
    with h:
        h.to_device(model)
        for m in h.to_device(lm_data(K)):
            loss_sum, _ = fb.causal_lm_loss(model(m["input_ids"]), m["labels"])
            loss_sum.item()
    assert h.count("read") == K, h.show()


def test_each_kind_of_read_and_copy_is_counted_and_host_numbers_are_not() -> None:
    h = HostSyncs()
    with h:
        on = h.to_device(torch.tensor([1.0, -2.0, 3.0]))
        host = torch.tensor([4.0, 5.0])
        host.tolist(), float(host.sum()), bool(host.any()), host[host > 4]  # host: free
        assert h.count("read") == 0
        reads = [
            lambda: float(on.sum()),
            lambda: bool(on.any()),
            lambda: on.tolist(),
            lambda: on.cpu(),
            lambda: on.to("cpu"),
            lambda: on[on > 0],  # a data-dependent shape
            lambda: torch.nonzero(on),
            lambda: torch.equal(on, on),
            lambda: host.copy_(on[:2]),  # into a host tensor
        ]
        for i, read in enumerate(reads, start=1):
            read()
            assert h.count("read") == i, (i, h.show())
        assert h.count("h2d") == 0
        assert on.cpu().device.type == "cpu" and on.device == DEVICE
        h.reset()
        moved = host.to(DEVICE, non_blocking=True)  # a copy, the host does not wait
        assert (h.count("h2d"), h.count("read")) == (1, 0) and moved.device == DEVICE
        on[torch.tensor([0, 2])]  # a host index: an implicit blocking copy
        assert (h.count("h2d"), h.count("read")) == (2, 1)
        torch.tensor([1, 2], device=DEVICE)  # blocking
        assert (h.count("h2d"), h.count("read")) == (3, 2)
        h.reset()
        made = torch.zeros(3, device=DEVICE) + on * 2 + 1.5  # factories and scalars: no copy
        torch._assert_async(made.sum() > 0)  # on a GPU, an asynchronous device assertion
        assert (h.count("h2d"), h.count("read")) == (0, 0) and made.is_cuda


# -- fullbatch ---------------------------------------------------------------------------------


def test_plain_loop_reads_once_per_window_and_never_per_micro_batch() -> None:
    for w in _steady(_train()):
        assert w["micro"] == [0] * K and w["h2d"] == [0] * K, w["events"]
        assert (w["open"], w["step"], w["window"]) == (0, 1, 1), w["events"]
        assert "_engine/_read.py" in w["events"]


def test_first_window_reads_only_for_the_one_time_label_checks() -> None:
    first = _train()[0]
    assert first["micro"][2:] == [0] * (K - 2) and first["step"] == 1, first["events"]
    reads = [line for line in first["events"].splitlines() if "[micro]" in line]
    assert reads and all("_engine/_labels.py" in line for line in reads), first["events"]


def test_grad_scaler_reads_once_per_window() -> None:
    for w in _steady(_train(scaler=True)):
        assert w["micro"] == [0] * K and (w["open"], w["step"]) == (0, 1), w["events"]


def test_counts_read_their_totals_once_per_window() -> None:
    counts = {"tokens": lambda m: fb.count_tokens(m["labels"]), "rows": lambda m: len(m["labels"])}
    for share in (None, "tokens"):
        for w in _steady(_train(counts=counts, share=share)):
            assert w["micro"] == [0] * K, w["events"]
            assert (w["open"], w["step"]) == (1, 1), w["events"]


def _windows(rows: int = 6, length: int = 8) -> list[dict[str, torch.Tensor]]:
    return [lm_data(1, rows=rows, length=length, seed=w)[0] for w in range(WINDOWS)]


SPLITS = {
    "sort_rows": {"micro_batch_size": 2, "sort_rows": True, "pad_to_multiple_of": 1},
    # the default on a GPU (64): every micro-batch padded past the window's 8 columns
    "sort_rows, x64": {"micro_batch_size": 2, "sort_rows": True},
    "micro_batch_tokens": {"micro_batch_tokens": 16},  # below 64 tokens: exact widths
    "micro_batch_tokens, x4": {"micro_batch_tokens": 16, "pad_to_multiple_of": 4},
    "pack": {"micro_batch_tokens": 16, "pack": True, "verify_pack": False},
    "pack, x4": {"micro_batch_tokens": 16, "pack": True, "verify_pack": False,
                 "pad_to_multiple_of": 4},
}  # fmt: skip
#: splits whose first windows read whether the columns cut away held only padding
CUTS = {"sort_rows", "micro_batch_tokens", "micro_batch_tokens, x4"}


@pytest.mark.parametrize("split", sorted(SPLITS))
def test_splitting_by_length_reads_lengths_and_copies_indices_once_per_window(split: str) -> None:
    windows = _train(_windows(), **SPLITS[split])
    if split in CUTS:  # the first two windows check that trimmed columns held only padding
        assert windows[1]["open"] == 2 and "_base/_take.py" in windows[1]["events"]
    for w in _steady(windows, after=2):
        assert len(w["micro"]) >= 2 and w["micro"] == [0] * len(w["micro"]), w["events"]
        assert w["h2d"] == [0] * len(w["micro"]), w["events"]
        assert (w["open"], w["step"]) == (1, 1), w["events"]  # the lengths, the step
        assert "_base/_sort_trim.py" in w["events"].splitlines()[0]


@pytest.mark.parametrize("split", sorted(SPLITS))
def test_splitting_copies_one_index_tensor_per_window_without_waiting(split: str) -> None:
    h = HostSyncs()
    with h:
        window = h.to_device(_windows()[0])
        model = h.to_device(TinyLM())
        acc = fb.Accumulator(model, torch.optim.SGD(model.parameters()), **SPLITS[split])
        h.reset()
        micros = list(next(iter(acc.windows([window]))))
        assert len(micros) >= 2
        copies = [e for e in h.events if e[1] == "h2d"]
        assert len(copies) == 1 and "non_blocking" in copies[0][2], h.show("h2d")
        # the lengths; in the first two windows, whether trimmed columns held only padding
        cut = any(m["input_ids"].shape[1] < window["input_ids"].shape[1] for m in micros)
        assert h.count("read") == (2 if split in CUTS and cut else 1), h.show()
        assert all(t.is_cuda for m in micros for t in m.values() if isinstance(t, torch.Tensor))


@pytest.mark.parametrize("split", sorted(SPLITS))
def test_splitting_host_data_reads_nothing(split: str) -> None:
    h = HostSyncs()
    with h:
        model = h.to_device(TinyLM())
        acc = fb.Accumulator(model, torch.optim.SGD(model.parameters()), **SPLITS[split])
        micros = list(next(iter(acc.windows(_windows()[:1]))))
    assert len(micros) >= 2 and h.count("read") == 0 and h.count("h2d") == 0, h.show()


def test_counts_on_the_device_are_checked_with_the_totals_one_read() -> None:
    """A negative device count from a ``counts=`` function (never read one by one) is refused
    when the window opens, before anything changes."""
    h = HostSyncs()
    torch.manual_seed(0)
    model = TinyLM()
    with h:
        h.to_device(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        before = [p.detach().clone() for p in model.parameters()]
        counts = {"tokens": lambda m: fb.count_tokens(m["labels"]) - 1000}
        acc = fb.Accumulator(model, opt, micro_batches=K, counts=counts)
        with pytest.raises(ValueError, match="counts= function returned a negative"):
            next(iter(acc.windows(h.to_device(lm_data(K)))))
        assert h.count("read") == 1, h.show()
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
        assert not opt.state and all(p.grad is None for p in model.parameters())

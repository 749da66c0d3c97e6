"""Padding-free packing (``micro_batch_tokens=T, pack=True``): the packed format, float64 steps
equal to the plain full batch on transformers Llama, Qwen2, Mistral (sliding window shorter
than a row) and GPT-2, and refusals; the packing check is in
``tests/integrations/test_hf_packing.py``."""

from __future__ import annotations

import io
import warnings

import pytest
import torch

import fullbatch as fb
from conftest import IGNORE, fb_loss, full_batch_reference, lm_batch, make_lm, rel_err, sgd_update
from fullbatch._base._packed import RowPacker, first_fit_decreasing

LENGTHS = [3, 11, 1, 7, 2, 9, 5, 6, 4, 10, 0]  # 11 rows (one empty), longest 11
WIDTH = 16
PACK_KEYS = {"position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}


def window(seed: int = 0, lengths: list[int] = LENGTHS) -> dict:
    return lm_batch(lengths, seed=seed, width=WIDTH, ignore_frac=0.2)


def packed(batch: dict, tokens: int, **options: object) -> list[dict]:
    model = make_lm()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with fb.Accumulator(model, opt, micro_batch_tokens=tokens, pack=True, **options) as acc:
        win = next(iter(acc.windows([batch])))
        micros = list(win)
        win.discard()
    return micros


# -- the format ------------------------------------------------------------------------------


def test_first_fit_decreasing_by_hand() -> None:
    assert first_fit_decreasing([3, 7, 2, 5, 1], 8) == [[1, 4], [3, 0], [2]]
    assert first_fit_decreasing([4, 4, 4], 8) == [[0, 1], [2]]
    assert first_fit_decreasing([9, 2, 0], 4) == [[0], [1]]  # over budget alone; empty row out
    assert first_fit_decreasing([], 4) == []


@pytest.mark.parametrize("tokens", [1, 11, 12, 16, 30, 1000])
def test_packed_format_holds_every_real_token_once(tokens: int) -> None:
    batch = window()
    batch["weight"] = torch.rand(len(LENGTHS), WIDTH, dtype=torch.float64)  # per token
    batch["step"] = 3  # a non-tensor leaf goes to every micro-batch
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rows over small budgets: tested below
        micros = packed(batch, tokens, token_keys=("input_ids", "labels", "weight"))
    seen: dict[int, int] = {}
    for m in micros:
        assert set(m) == {"input_ids", "labels", "weight", "step", "use_cache"} | PACK_KEYS
        n = m["input_ids"].shape[1]
        assert m["input_ids"].shape == m["labels"].shape == m["position_ids"].shape == (1, n)
        assert m["weight"].shape == (1, n) and m["step"] == 3 and m["use_cache"] is False
        cu = m["cu_seq_lens_q"]
        assert cu.dtype == torch.int32 and torch.equal(cu, m["cu_seq_lens_k"])
        sizes = (cu[1:] - cu[:-1]).tolist()
        assert cu[0] == 0 and cu[-1] == n and min(sizes) > 0
        assert m["max_length_q"] == m["max_length_k"] == max(sizes)
        assert n <= tokens or len(sizes) == 1  # a longer row is alone
        positions = torch.cat([torch.arange(k) for k in sizes])
        assert torch.equal(m["position_ids"][0], positions)
        starts = cu[:-1].long()
        assert (m["labels"][0, starts] == IGNORE).all()
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
            # find the row: same tokens and weights as one row of the window, seen once
            hits = [
                r
                for r in range(len(LENGTHS))
                if LENGTHS[r] == b - a
                and torch.equal(batch["input_ids"][r, : b - a], m["input_ids"][0, a:b])
                and torch.equal(batch["weight"][r, : b - a], m["weight"][0, a:b])
                and torch.equal(batch["labels"][r, 1 : b - a], m["labels"][0, a + 1 : b])
            ]
            assert len(hits) == 1
            seen[hits[0]] = seen.get(hits[0], 0) + 1
    assert seen == {r: 1 for r, n in enumerate(LENGTHS) if n > 0}
    # the causal count is the padded window's: each row's first label was never predicted
    counted = sum(int((m["labels"][0, 1:] != IGNORE).sum()) for m in micros)
    assert counted == int((batch["labels"][:, 1:] != IGNORE).sum())


def test_row_longer_than_budget_is_alone_and_warned_once() -> None:
    with pytest.warns(UserWarning, match="a row of 11 tokens is longer than micro_batch_tokens=8"):
        micros = packed(window(), 8)
    assert [int(m["max_length_q"]) for m in micros][:3] == [11, 10, 9]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the correct form does not warn
        packed(window(), 11)


def test_lengths_callable_and_key() -> None:
    batch = window()
    mask = batch.pop("attention_mask")
    got = packed(batch, 16, lengths=lambda item: torch.tensor(LENGTHS))
    batch["mask"] = mask
    by_key = packed(batch, 16, lengths="mask")
    assert all("mask" not in m for m in by_key)
    for a, b in zip(got, by_key, strict=True):
        assert torch.equal(a["input_ids"], b["input_ids"])


# -- exactness -------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", [1, 11, 16, 20, 33, 1000])
def test_one_step_equals_full_batch(tokens: int) -> None:
    batch = window(seed=tokens)
    model = make_lm()
    ref = full_batch_reference(model, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        grads, stats = sgd_update(model, [batch], micro_batch_tokens=tokens, pack=True)
    assert rel_err(grads, ref.grads) < 1e-10
    assert stats.count == ref.count
    assert stats.loss == pytest.approx(ref.loss, rel=1e-10)


def test_auto_budget_equals_the_found_budget_and_the_full_batch() -> None:
    from _auto_cases import TokenLM

    data = [window(seed=s) for s in range(2)]
    found: list[int | None] = []

    def run(budget: int | str) -> tuple[list[fb.StepStats], list[torch.Tensor]]:
        model = TokenLM(tokens=20).double()
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        before = [p.detach().clone() for p in model.parameters()]
        out = []
        # the fixed budget's check would run out of memory on this toy (it needs rows x
        # longest row tokens); without it the run must equal the checked "auto" run anyway
        check = budget == "auto"
        with fb.Accumulator(
            model, opt, micro_batch_tokens=budget, pack=True, verify_pack=check
        ) as acc:
            for win in acc.windows(data[:1]):
                out.append(win.run(lambda m: fb.causal_lm_loss(model(m["input_ids"]), m["labels"])))
                found.append(acc.micro_batch_tokens)
            if check:
                assert acc._engine.pack_check is not None and acc._engine.pack_check.report.passed
        return out, [b - p.detach() for b, p in zip(before, model.parameters(), strict=True)]

    stats, update = run("auto")
    budget = found[0]
    assert budget is not None and budget <= 20 and stats[0].retries >= 1
    fixed_stats, fixed_update = run(budget)
    assert all(torch.equal(a, b) for a, b in zip(update, fixed_update, strict=True))
    assert fixed_stats[0].retries == 0
    ref = full_batch_reference(TokenLM(tokens=10**6).double(), data[0], _token_lm_loss)
    assert rel_err(update, ref.grads) < 1e-10


def _token_lm_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    loss_sum, n = fb.causal_lm_loss(model(batch["input_ids"]), batch["labels"])
    return loss_sum / n


def _save(*objs: object) -> list:
    buf = io.BytesIO()
    torch.save([o.state_dict() for o in objs], buf)  # type: ignore[attr-defined]
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_resume_mid_window_is_bitwise() -> None:
    loader = [window(seed=s) for s in range(3)]

    def build(seed: int) -> tuple:
        model = make_lm(seed=seed)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        return model, opt, fb.Accumulator(model, opt, micro_batch_tokens=20, pack=True)

    def train(objs: tuple, items: list, stop: tuple[int, int] | None = None) -> list | None:
        model, _, acc = objs
        for w, win in enumerate(acc.windows(items)):
            for j, micro in enumerate(win):
                win.backward(*fb_loss(model, micro))
                if (w, j + 1) == stop:
                    return _save(*objs)
            win.step()
        return None

    whole = build(0)
    train(whole, loader)
    first = build(0)
    states = train(first, loader, stop=(1, 2))
    assert states is not None
    first[2].close()
    fresh = build(5)
    for obj, state in zip(fresh, states, strict=True):
        obj.load_state_dict(state)
    assert train(fresh, loader[states[2]["loader_items"] :]) is None
    for a, b in zip(whole[0].parameters(), fresh[0].parameters(), strict=True):
        assert torch.equal(a, b)


# -- refusals --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"micro_batch_size": 2, "pack": True}, "pack=True packs .* micro_batch_size=2"),
        ({"micro_batches": 2, "pack": True}, "give micro_batch_tokens=T .* micro_batches=2"),
        ({"micro_batch_tokens": 8, "pack": "yes"}, "pack must be True or False, got 'yes'"),
        ({"micro_batch_tokens": 8, "pack": True, "verify_pack": 1}, "verify_pack must be"),
        ({"micro_batch_tokens": 8, "pack": True, "sort_rows": True}, "sort_rows=True sorts"),
    ],
)
def test_bad_options_are_refused(options: dict, match: str) -> None:
    model = make_lm()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=match):
        fb.Accumulator(model, opt, **options)


def _per_row(batch: dict) -> dict:
    return dict(batch, y=torch.arange(len(LENGTHS)))


def _own_positions(batch: dict) -> dict:
    return dict(batch, position_ids=torch.arange(WIDTH).expand(len(LENGTHS), WIDTH))


def _left(batch: dict) -> dict:
    return dict(batch, attention_mask=batch["attention_mask"].flip(1))


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (_per_row, r"item\['y'\] has shape \(11,\) .*one entry per token.*pack=False"),
        (_own_positions, "builds 'position_ids' itself.*Remove 'position_ids'"),
        (_left, "needs right-padded rows.*padding_side = 'right'"),
        (lambda b: (b["input_ids"], b["labels"]), "dict of tensors.*got a tuple"),
    ],
)
def test_items_that_cannot_pack_are_refused_before_anything_changes(make, match) -> None:
    model = make_lm()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with fb.Accumulator(model, opt, micro_batch_tokens=16, pack=True) as acc:
        with pytest.raises(ValueError, match=match):
            for win in acc.windows([make(window())]):
                win.run(lambda m: fb_loss(model, m))
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters()) and not opt.state


def test_run_coupled_is_refused_before_anything_changes() -> None:
    model = make_lm()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with fb.Accumulator(model, opt, micro_batch_tokens=16, pack=True) as acc:
        windows = acc.windows([window(), window(seed=1)])
        win = next(windows)
        with pytest.raises(ValueError, match=r"run_coupled needs representations.*without pack"):
            win.run_coupled(lambda m: model.embed(m["input_ids"]), lambda r, rows: (r.sum(), 1))
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
        assert all(p.grad is None for p in model.parameters())
        stats = next(windows).run(lambda m: fb_loss(model, m))  # the next window trains
    assert stats.count > 0 and acc.steps == 1
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


def test_packer_direct_and_empty() -> None:
    batch = window(lengths=[0, 0, 0])
    assert RowPacker(micro_batch_tokens=4)(batch) == []
    assert RowPacker(micro_batch_tokens=4).window_tokens(window()) == sum(LENGTHS)


def test_contract_names_are_keyword_only_with_their_defaults() -> None:
    import inspect

    params = inspect.signature(fb.Accumulator).parameters
    assert params["pack"].default is False and params["pack"].kind is params["pack"].KEYWORD_ONLY
    assert params["verify_pack"].default is True

"""``cross_entropy_sum``, ``causal_lm_loss`` and ``count_tokens`` against ``F.cross_entropy``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fullbatch as fb
from conftest import IGNORE


def random_labels(shape, classes: int, ignore_frac: float, seed: int = 0, ignore=IGNORE):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, shape, generator=g)
    return labels.masked_fill(torch.rand(shape, generator=g) < ignore_frac, ignore)


def reference(logits, labels, ignore_index=IGNORE, shift=False):
    if shift:
        logits, labels = logits[..., :-1, :], labels[..., 1:]
    flat, y = logits.reshape(-1, logits.shape[-1]).double(), labels.reshape(-1)
    return (
        F.cross_entropy(flat, y, ignore_index=ignore_index, reduction="sum"),
        int((y != ignore_index).sum()),
    )


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4)])
@pytest.mark.parametrize("ignore_frac", [0.0, 0.3, 0.9])
def test_cross_entropy_sum_matches_f_cross_entropy(shape, ignore_frac) -> None:
    classes = 6
    logits = torch.randn(*shape, classes, dtype=torch.float64, requires_grad=True)
    labels = random_labels(shape, classes, ignore_frac, seed=len(shape))
    loss_sum, n = fb.cross_entropy_sum(logits, labels)
    want, want_n = reference(logits, labels)
    assert loss_sum.dim() == 0 and n.dim() == 0 and n.dtype == torch.int64
    assert int(n) == want_n
    torch.testing.assert_close(loss_sum, want, rtol=1e-14, atol=0)
    (got_grad,) = torch.autograd.grad(loss_sum, logits)
    (want_grad,) = torch.autograd.grad(want, logits)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-14, atol=1e-16)
    if want_n:  # sum / count is PyTorch's mean reduction
        mean = F.cross_entropy(logits.reshape(-1, classes), labels.reshape(-1), ignore_index=IGNORE)
        torch.testing.assert_close(loss_sum / n, mean, rtol=1e-14, atol=0)


@pytest.mark.parametrize("ignore_frac", [0.0, 0.4])
def test_causal_lm_loss_is_shifted_cross_entropy(ignore_frac) -> None:
    vocab = 9
    logits = torch.randn(3, 6, vocab, dtype=torch.float64, requires_grad=True)
    labels = random_labels((3, 6), vocab, ignore_frac, seed=1)
    loss_sum, n = fb.causal_lm_loss(logits, labels)
    want, want_n = reference(logits, labels, shift=True)
    assert int(n) == want_n
    torch.testing.assert_close(loss_sum, want, rtol=1e-14, atol=0)
    # explicit: position t predicts label t + 1
    manual = sum(
        -torch.log_softmax(logits[b, t], -1)[labels[b, t + 1]]
        for b in range(3)
        for t in range(5)
        if labels[b, t + 1] != IGNORE
    )
    torch.testing.assert_close(loss_sum, manual, rtol=1e-13, atol=0)
    same, same_n = fb.cross_entropy_sum(logits, labels, shift=True)
    assert torch.equal(same, loss_sum) and torch.equal(same_n, n)
    (g,) = torch.autograd.grad(loss_sum, logits)
    assert torch.all(g[:, -1] == 0)  # the last position predicts nothing


def test_custom_ignore_index() -> None:
    logits = torch.randn(4, 5, 7, dtype=torch.float64)
    labels = random_labels((4, 5), 7, 0.3, seed=2, ignore=0)
    loss_sum, n = fb.causal_lm_loss(logits, labels, ignore_index=0)
    want, want_n = reference(logits, labels, ignore_index=0, shift=True)
    assert int(n) == want_n
    torch.testing.assert_close(loss_sum, want, rtol=1e-14, atol=0)
    assert int(fb.count_tokens(labels, ignore_index=0)) == want_n


@pytest.mark.parametrize(
    "dtype,want",
    [
        (torch.float16, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float32),
        (torch.float64, torch.float64),
    ],
)
@pytest.mark.parametrize("fn", ["cross_entropy_sum", "causal_lm_loss"])
def test_dtype_promotion(dtype, want, fn) -> None:
    logits64 = torch.randn(2, 5, 11, dtype=torch.float64) * 4
    logits = logits64.to(dtype).requires_grad_()
    labels = random_labels((2, 5), 11, 0.2, seed=3)
    loss_sum, _ = getattr(fb, fn)(logits, labels)
    assert loss_sum.dtype == want
    # computed in the promoted dtype: equal to the float64 loss of the *rounded* logits
    ref, _ = reference(logits.detach().double(), labels, shift=fn == "causal_lm_loss")
    tol = 1e-14 if want == torch.float64 else 1e-6
    torch.testing.assert_close(loss_sum.double(), ref, rtol=tol, atol=0)
    loss_sum.backward()
    assert logits.grad is not None and logits.grad.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16])
def test_all_ignored_micro_batch_gives_zero_and_zero_grads(dtype) -> None:
    logits = torch.randn(2, 4, 5).to(dtype).requires_grad_()
    labels = torch.full((2, 4), IGNORE)
    for fn in (fb.cross_entropy_sum, fb.causal_lm_loss):
        loss_sum, n = fn(logits, labels)
        assert float(loss_sum.detach()) == 0.0 and int(n) == 0
        (g,) = torch.autograd.grad(loss_sum, logits)
        assert torch.all(g == 0), g  # zeros, not NaN
    # one-token rows: nothing is predicted after the shift
    single = torch.randn(3, 1, 5, dtype=torch.float64, requires_grad=True)
    loss_sum, n = fb.causal_lm_loss(single, torch.tensor([[1], [2], [3]]))
    assert float(loss_sum.detach()) == 0.0 and int(n) == 0
    (g,) = torch.autograd.grad(loss_sum, single)
    assert torch.all(g == 0)


@pytest.mark.parametrize("shift", [True, False])
@pytest.mark.parametrize("shape", [(4, 6), (1, 1), (3, 2), (5,)])
def test_count_tokens_equals_returned_count(shift, shape) -> None:
    if shift and len(shape) == 1:
        shape = (1, *shape)
    labels = random_labels(shape, 8, 0.35, seed=sum(shape))
    logits = torch.randn(*shape, 8)
    _, n = fb.cross_entropy_sum(logits, labels, shift=shift)
    count = fb.count_tokens(labels, shift=shift)
    assert count.dim() == 0 and count.dtype == torch.int64
    assert torch.equal(count, n)
    flat = labels[..., 1:] if shift else labels
    assert int(count) == int((flat != IGNORE).sum())


def test_shape_mismatch_raises_with_shapes() -> None:
    with pytest.raises(ValueError, match=r"\(2, 3, 4\).*\(2, 4\).*labels\.shape"):
        fb.cross_entropy_sum(torch.randn(2, 3, 4), torch.zeros(2, 4, dtype=torch.long))

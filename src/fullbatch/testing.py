"""For your own test suite: ``fb.testing.assert_equivalent``, and tiny models to try things on.

``tiny_causal_lm``, ``tiny_seq2seq`` and ``char_tokenizer`` build small Hugging Face models
and a character tokenizer from a config, in code (seeded, float64 by default, nothing
downloaded; they need ``transformers``, e.g. ``pip install "fullbatch[trl]"``), as the docs'
TRL and Trainer examples use them.

>>> import torch, fullbatch as fb
>>> model = torch.nn.Linear(3, 2).double()
>>> batch = {"x": torch.randn(5, 3, dtype=torch.float64), "y": torch.tensor([0, 1, 1, 0, 1])}
>>> report = fb.testing.assert_equivalent(
...     model, batch, lambda m, b: fb.cross_entropy_sum(m(b["x"]), b["y"]), micro_batch_size=2
... )
>>> report.passed
True
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fullbatch._demo._trl_tiny import char_tokenizer, tiny_causal_lm, tiny_seq2seq
from fullbatch._verify._arms import LossFn
from fullbatch._verify._report import VerifyReport
from fullbatch._verify._run import verify

__all__ = ["assert_equivalent", "char_tokenizer", "tiny_causal_lm", "tiny_seq2seq"]


def assert_equivalent(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    *,
    micro_batch_size: int,
    dtype: torch.dtype | None = None,
    autocast: torch.dtype | None = None,
    rtol: float | None = None,
) -> VerifyReport:
    """Assert that fullbatch gives the full-batch gradient on ``model`` and ``batch``.

    Runs :func:`fullbatch.verify` with the same arguments and leaves the model as it was.

    Returns:
        The :class:`~fullbatch.VerifyReport` when it passed (for further checks).

    Raises:
        ValueError: bad arguments, e.g. ``micro_batch_size`` >= the batch's rows (a single
            micro-batch proves nothing).
        AssertionError: with the full report text (errors, additivity, diagnosis) when the
            gradients differ beyond the tolerance or the loss cannot be accumulated exactly.
    """
    report = verify(
        model,
        batch,
        loss_fn,
        micro_batch_size=micro_batch_size,
        dtype=dtype,
        autocast=autocast,
        rtol=rtol,
    )
    if not report.passed:
        raise AssertionError(f"fullbatch is not equivalent to the full batch:\n{report}")
    return report

"""fullbatch.hf.ExactTrainer with FSDP in the Hugging Face Trainer, 2 gloo ranks on CPU.

- The Trainer's FSDP2 configuration (``fsdp="full_shard", fsdp_config={"fsdp_version": 2}``):
  on a CPU machine Accelerate runs it as DDP (``MULTI_CPU``, no FSDP plugin kept, the model
  wrapped in ``DistributedDataParallel``), which the test asserts; ExactTrainer is exact there.
- A model sharded by FSDP2 at load time (``from_pretrained(distributed_config=...)``), which
  the Trainer trains without wrapping it: every step's sharded gradient is normalized through
  FSDP2's divide factor and the shards' norm summed over the ranks (tests/_fsdp_trainer_cases.py).

Every rank's parameters after every step equal a plain float64 PyTorch full batch over both
ranks' rows of the window (tests/_hf_cases.py ``torch_reference``; windows of 16, 16 and 8
rows, uneven token counts per rank). FSDP1 is refused before anything is built.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import _fsdp_trainer_cases as cases
from _dist import run_ranks, values
from _hf_cases import llama, step_errors, text_rows, torch_reference

pytestmark = pytest.mark.timeout(400)

TOL = 1e-7  # the tiny Llama computes RMSNorm in float32 (tests/integrations/test_hf_trainer.py)
RUNS = [("config", True), ("loaded", True), ("loaded", False)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: Any) -> list[dict[Any, Any]]:
    path = str(tmp_path_factory.mktemp("llama"))
    llama().save_pretrained(path)
    return values(run_ranks(cases.train_all, 2, RUNS, path, deadline=300.0))


def _windows(results: list[dict[Any, Any]], run: tuple[str, bool]) -> list[list[Any]]:
    rows = text_rows(cases.ROWS)
    seen = [r[run]["seen"] for r in results]
    k = cases.K
    per_rank = [[[i for m in s[w : w + k] for i in m] for w in range(0, len(s), k)] for s in seen]
    windows = [[rows[i] for i in a + b] for a, b in zip(*per_rank, strict=True)]
    assert [len(w) for w in windows] == [16, 16, 8]
    return windows


@pytest.mark.parametrize("run", RUNS[:2], ids=["fsdp2-config", "fsdp2-loaded"])
def test_exact_trainer_under_fsdp_steps_like_the_full_batch(
    trained: list[dict[Any, Any]], run: tuple[str, bool]
) -> None:
    ref = torch_reference(llama, _windows(trained, run), "causal_lm")
    for rank, result in enumerate(trained):
        got = result[run]
        errors = step_errors(got, ref, llama())
        assert max(errors) < TOL, (run, rank, errors)
        assert got["counters"] == (3, 0)
        if run[0] == "config":  # what Accelerate made of the FSDP2 configuration on CPU
            assert got["ddp"] and not got["fsdp2"] and not got["is_fsdp_enabled"]
            assert got["distributed_type"] == "DistributedType.MULTI_CPU"
        else:
            assert got["fsdp2"] and not got["ddp"]
    last = [result[run]["steps"][-1] for result in trained]
    for name, value in last[0].items():
        assert torch.equal(value, last[1][name]), name


def test_the_sharded_run_is_checked_against_the_same_reference(
    trained: list[dict[Any, Any]],
) -> None:
    """The stock Trainer on the FSDP2-loaded Llama (which honours num_items_in_batch) is
    exact too: the reference and the gathering are right, not tuned to fullbatch's route."""
    run = RUNS[2]
    ref = torch_reference(llama, _windows(trained, run), "causal_lm")
    errors = step_errors(trained[0][run], ref, llama())
    assert max(errors) < 1e-6, errors


def test_fsdp1_is_refused_before_the_model_changes() -> None:
    from transformers import TrainingArguments

    from fullbatch.hf._settings import refuse_args

    args = TrainingArguments(
        "unused", use_cpu=True, fsdp="full_shard", fsdp_config={"fsdp_version": 1}
    )
    with pytest.raises(ValueError, match=r"FSDP1 \(fsdp_config version 1\).*'version': 2"):
        refuse_args("ExactTrainer", args)
    refuse_args("ExactTrainer", TrainingArguments("unused", use_cpu=True, fsdp="full_shard"))


def test_the_sharded_norm_is_summed_over_the_ranks() -> None:
    """The squared norm of FSDP2's gradient shards, summed over the ranks, is the whole
    gradient's on every rank, so every rank reaches the same verdict (an inf in one rank's
    shard skips the window everywhere); the local sum alone would not."""
    results = values(run_ranks(cases.shard_norm, 2, deadline=120.0))
    for rank, result in enumerate(results):
        assert result["divisor"] == (2.0, 1.0)
        whole, sharded, replicated = result[False]
        assert sharded == pytest.approx(whole, rel=1e-12) and replicated < whole
        whole, sharded, replicated = result[True]
        assert whole == sharded == float("inf")
        # this rank's shards alone: rank 0 would step while rank 1 skips
        assert (replicated == float("inf")) == (rank == 1)

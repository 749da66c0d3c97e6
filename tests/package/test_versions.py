"""Declared ranges that hold (issue 18): below a feature's real minimum, a clear error."""

from __future__ import annotations

import pytest
import torch

import fullbatch as fb
from fullbatch._base._versions import (
    check_fsdp2_device,
    check_pipeline_schedule,
    torch_version,
    trainer_parallel_size,
)


def test_fully_shard_on_cpu_below_torch_2_7_names_the_version_and_the_fix() -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match=r"needs torch >= 2\.7, found 2\.6\.0.*pytorch#145935"):
        check_fsdp2_device(model, "2.6.0+cpu")
    check_fsdp2_device(model, "2.7.0")  # the first release with the fix
    if torch_version() >= (2, 7):
        check_fsdp2_device(model)  # this torch
    else:
        with pytest.raises(RuntimeError, match="pytorch#145935"):
            check_fsdp2_device(model)
    assert torch_version() >= (2, 6)


def test_trainer_without_context_or_sequence_parallel_getters_counts_them_as_one() -> None:
    class Trainer453:  # transformers 4.53: get_tp_size only
        def get_tp_size(self) -> int:
            return 1

    class Recent(Trainer453):
        def get_cp_size(self) -> int:
            return 2

        def get_sp_size(self) -> int:
            return 1

    assert trainer_parallel_size(Trainer453()) == 1
    assert trainer_parallel_size(Recent()) == 2


def test_pipeline_schedule_without_scale_grads_names_torch_2_7() -> None:
    class Schedule26:  # torch 2.6's schedules: no scale_grads flag (and no gradient scaling)
        _loss_fn = fb.PipelineLoss(fb.cross_entropy_sum)

    class Schedule27(Schedule26):
        scale_grads = False

    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
    with pytest.raises(RuntimeError, match=r"Pipeline needs torch >= 2\.7, found .*scale_grads"):
        fb.Pipeline(Schedule26(), opt)
    with pytest.raises(RuntimeError, match=r"needs torch >= 2\.7, found 2\.6\.0"):
        check_pipeline_schedule(Schedule26(), "2.6.0")
    check_pipeline_schedule(Schedule27())  # the flag present: no error

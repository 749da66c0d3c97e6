"""Declared ranges that hold (issue 18): below a feature's real minimum, a clear error."""

from __future__ import annotations

import pytest
import torch

from fullbatch._base._versions import check_fsdp2_device, torch_version, trainer_parallel_size


def test_fsdp2_on_cpu_below_torch_2_7_names_the_version_and_the_fix() -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match=r"needs torch >= 2\.7, found 2\.6\.0.*pytorch#145935"):
        check_fsdp2_device(model, "2.6.0+cpu")
    check_fsdp2_device(model, "2.7.0")  # the first release with the fix
    check_fsdp2_device(model)  # this torch
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

"""What fullbatch.deepspeed refuses, on stand-ins for a DeepSpeed engine (no deepspeed needed):
each configuration whose step cannot be made exact raises with the reason and the fix."""

from __future__ import annotations

from typing import Any

import pytest

from fullbatch.deepspeed import OFFLOAD_FIXED, check_engine


class Engine:
    def __init__(self, stage: int = 2, offload: bool = False, **kw: Any) -> None:
        self.stage, self.offload = stage, offload
        self.dp_world_size = kw.get("dp", 2)
        self.seq_dp_world_size = kw.get("seq_dp", self.dp_world_size)
        self.has_moe_layers = kw.get("moe", False)
        self.half = kw.get("half", False)

    def zero_optimization_stage(self) -> int:
        return self.stage

    def zero_use_cpu_optimizer(self) -> bool:
        return self.offload

    def fp16_enabled(self) -> bool:
        return self.half

    def bfloat16_enabled(self) -> bool:
        return False


@pytest.mark.parametrize("stage", [1, 2])
def test_offload_before_the_fix_is_refused_with_the_bug_named(stage: int) -> None:
    with pytest.raises(ValueError, match=r"#6550.*#7967.*upgrade deepspeed"):
        check_engine(Engine(stage, offload=True), 4, "0.17.0")
    check_engine(Engine(stage, offload=True), 1, "0.17.0")  # one micro-batch: nothing dropped
    check_engine(Engine(stage, offload=True), 4, ".".join(map(str, OFFLOAD_FIXED)))
    check_engine(Engine(3, offload=True), 4, "0.17.0")  # ZeRO-3 offload was not affected


@pytest.mark.parametrize(
    ("engine", "words"),
    [
        (Engine(moe=True), "MoE layers"),
        (Engine(seq_dp=1), "sequence parallelism"),
        (Engine(0, half=True), "ZeRO stage 0"),
    ],
)
def test_groups_fullbatch_cannot_count_are_refused(engine: Engine, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        check_engine(engine, 4, "0.19.8")

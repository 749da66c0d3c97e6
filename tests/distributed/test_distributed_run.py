"""``window.run`` under DDP and FSDP2: an exception in the user's function abandons the window
on that rank (no gradients, sync flags restored); when every rank raises, the next window
trains exactly."""

from __future__ import annotations

import pytest
import torch

import _dist_run as cases
from _dist import run_ranks, values

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp"])
def test_error_in_fn_abandons_the_window_and_training_goes_on(wrapper: str) -> None:
    results = values(run_ranks(cases.run_with_error, 2, wrapper, pg_timeout=20))
    ref = cases.reference(2)
    for res in results:
        assert res["raised"]
        assert not any(res["grads_after_error"])
        assert res["sync_flag"] is True
        assert torch.equal(res["params"], results[0]["params"])
        err = ((res["params"] - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-10, err

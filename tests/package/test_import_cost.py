"""Importing a wing loads what it needs, not the rest (``benchmarks/import_time.py`` measures it).

- the core never imports ``torch.distributed.fsdp`` itself (about 1 s of CPU: it pulls
  ``torch.export`` and ``sympy``); an FSDP2 model's user has imported it already;
- ``fullbatch.hf`` loads ``check_trainer``'s machinery (the verify arms, the Accumulator) on
  first use;
- ``from fullbatch.trl import ExactSFTTrainer`` loads neither the DPO nor the GRPO trainer.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_SRC = str(Path(__file__).parents[2] / "src")


def _run(code: str) -> list[str]:
    env = {**os.environ, "PYTHONPATH": _SRC}
    result = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_the_core_does_not_import_fsdp() -> None:
    """(Constructing a torch optimizer imports ``torch._dynamo``, which imports FSDP: that cost
    is torch's own, paid with or without fullbatch.)"""
    code = (
        "import sys, fullbatch as fb\n"
        "print(fb.Accumulator.__name__, fb.Window.__name__, fb.verify.__name__, "
        "'torch.distributed.fsdp' in sys.modules, 'sympy' in sys.modules)\n"
    )
    assert _run(code) == ["Accumulator", "Window", "verify", "False", "False"]


def test_fsdp_models_are_still_recognised_once_fsdp_is_imported() -> None:
    import torch
    from torch.distributed.fsdp import FSDPModule

    from fullbatch._base._sync._fsdp import is_fsdp

    class Sharded(FSDPModule):  # fully_shard gives the model such a class
        pass

    assert is_fsdp(object.__new__(Sharded))
    assert not is_fsdp(torch.nn.Linear(2, 1))


def test_hf_loads_the_check_on_first_use() -> None:
    pytest.importorskip("transformers")
    code = (
        "import sys, fullbatch.hf\n"
        "print('fullbatch._verify._hf_check' in sys.modules, "
        "'fullbatch._engine._accumulator' in sys.modules)\n"
        "from fullbatch.hf import check_trainer, TrainerCheck\n"
        "print(check_trainer.__module__, TrainerCheck.__name__)\n"
    )
    assert _run(code) == ["False", "False", "fullbatch._verify._hf_check", "TrainerCheck"]


def test_trl_loads_each_trainer_on_first_use() -> None:
    pytest.importorskip("trl")
    code = (
        "import sys\n"
        "from fullbatch.trl import ExactSFTTrainer\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('fullbatch.trl.'))\n"
        "print(','.join(loaded), 'fullbatch._verify._hf_check' in sys.modules)\n"
        "import fullbatch.trl\n"
        "print(fullbatch.trl.ExactDPOTrainer.__mro__[2].__name__, "
        "sorted(set(fullbatch.trl.__all__) - set(dir(fullbatch.trl))))\n"
        "try:\n"
        "    fullbatch.trl.ExactPPOTrainer\n"
        "except AttributeError as exc:\n"
        "    print(type(exc).__name__)\n"
    )
    assert _run(code) == [
        "fullbatch.trl._refuse,fullbatch.trl._sft,fullbatch.trl._step",
        "False",
        "DPOTrainer",
        "[]",
        "AttributeError",
    ]


def test_fullbatch_never_imports_super_gradients() -> None:
    """``fullbatch.super_gradients`` imports Super-Gradients (seconds, and a numpy<=1.23 pin)
    only when it is imported itself; the core and the probe (which names Super-Gradients'
    Trainer by its classes' package) never do."""
    code = (
        "import sys, fullbatch as fb\n"
        "fb.Accumulator, fb.probe, fb.verify\n"
        "print('fullbatch.super_gradients' in sys.modules, 'super_gradients' in sys.modules)\n"
    )
    assert _run(code) == ["False", "False"]


def test_the_probe_does_not_import_the_engine() -> None:
    """Checking code that does not use ``fb.Accumulator`` loads neither it nor ``fb.verify``:
    the probe and verify share ``fullbatch._proof`` instead."""
    code = (
        "import sys, fullbatch._probe._run\n"
        "print(sorted({m.split('.')[1] for m in sys.modules if m.startswith('fullbatch.')}))\n"
    )
    assert _run(code) == ["['_base',", "'_probe',", "'_proof']"]

"""The public surface: a short, honest ``__all__``, keyword-only options, the CLI entry point."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import inspect

import pytest

import fullbatch as fb

# DESIGN.md "Public contract" plus the documented handles (Window, StepStats) and __version__,
# and the "verify" entry points (DESIGN "Beyond the anchors": a verify on the user's model).
DOCUMENTED = {
    "Accumulator",
    "Pipeline",
    "PipelineLoss",
    "StepStats",
    "Window",
    "__version__",
    "causal_lm_loss",
    "count_tokens",
    "cross_entropy_sum",
    "verify",
    "VerifyReport",
    "testing",
    "moe",
    "scale_lr",
    "row_windows",
    "probe",
}


def test_all_is_exactly_the_documented_names() -> None:
    assert len(fb.__all__) == len(set(fb.__all__)), "duplicates in __all__"
    assert set(fb.__all__) == DOCUMENTED


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_every_name_is_importable(name: str) -> None:
    module = importlib.import_module("fullbatch")
    assert getattr(module, name) is not None
    exec(f"from fullbatch import {name}", {})


def test_star_import_gives_all() -> None:
    namespace: dict = {}
    exec("from fullbatch import *", namespace)
    assert set(fb.__all__) - {"__version__"} <= set(namespace)


def test_version_matches_metadata() -> None:
    assert fb.__version__ == importlib.metadata.version("fullbatch")


def test_accumulator_options_are_keyword_only() -> None:
    sig = inspect.signature(fb.Accumulator)
    positional = [
        p.name
        for p in sig.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    assert positional == ["model", "optimizer"]
    for name in (
        "micro_batches",
        "micro_batch_size",
        "scheduler",
        "scaler",
        "max_grad_norm",
        "partial_window",
        "counts",
        "process_group",
        "batchnorm",
    ):
        assert sig.parameters[name].kind is inspect.Parameter.KEYWORD_ONLY, name
    assert sig.parameters["partial_window"].default == "step"


# DESIGN.md's Accumulator keywords with their defaults, by group (the docstring's groups).
ACCUMULATOR_OPTIONS = {
    "How a loader item becomes micro-batches": {
        "micro_batches": None,
        "micro_batch_size": None,
        "micro_batch_tokens": None,
        "sort_rows": False,
        "pad_to_multiple_of": None,
        "lengths": "attention_mask",
        "token_keys": None,
        "pack": False,
        "verify_pack": True,
        "partial_window": "step",
        "padding_micro_batch": None,
        "counts": None,
    },
    "Sync": {
        "ddp_sync": None,  # "last", or "step" with an "auto" size
        "fsdp_sync": None,
        "grad_divisor": None,
        "process_group": None,
        "context_parallel": None,
        "data_mesh_dims": None,  # composed meshes: the data dims, discovered by default
    },
    "The step": {
        "scheduler": None,
        "scaler": None,
        "max_grad_norm": None,
        "accumulate_dtype": None,
        "batchnorm": None,
    },
}


def test_accumulator_options_names_defaults_and_groups() -> None:
    """Every option keeps its name and default; the docstring presents them in groups."""
    sig = inspect.signature(fb.Accumulator)
    got = {n: p.default for n, p in sig.parameters.items() if n not in ("model", "optimizer")}
    want = {n: d for group in ACCUMULATOR_OPTIONS.values() for n, d in group.items()}
    assert got == want
    doc = fb.Accumulator.__doc__ or ""
    starts = [doc.index(f"**{group}") for group in ACCUMULATOR_OPTIONS]
    assert starts == sorted(starts)
    for i, options in enumerate(ACCUMULATOR_OPTIONS.values()):
        end = starts[i + 1] if i + 1 < len(starts) else len(doc)
        for name in options:
            assert f"\n        {name}: " in doc[starts[i] : end], name


def test_mode_strings_are_literal_types() -> None:
    hints = inspect.signature(fb.Accumulator).parameters
    for name, modes in {
        "partial_window": ("step", "drop"),
        "ddp_sync": ("last", "step"),
        "fsdp_sync": ("window", "micro_batch", "hybrid"),
        "batchnorm": ("window",),
        "micro_batch_size": ("auto",),
        "micro_batch_tokens": ("auto",),
    }.items():
        annotation = str(hints[name].annotation)
        assert "Literal[" + ", ".join(repr(m) for m in modes) + "]" in annotation, annotation


def test_probe_signature() -> None:
    """DESIGN.md parts 4-5: fb.probe(model=None, optimizer=None, *, objective, windows, ranks);
    windows=None checks the first two windows (part 5). ``coupled=False`` (issue 40: a
    callable objective declared coupled) comes after them, keyword-only, so every call of the
    contract's spelling means what it did."""
    sig = inspect.signature(fb.probe)
    assert list(sig.parameters) == [
        "model", "optimizer", "objective", "windows", "ranks", "coupled",
    ]  # fmt: skip
    kinds = [p.kind for p in sig.parameters.values()]
    assert kinds[2:] == [inspect.Parameter.KEYWORD_ONLY] * 4
    defaults = {n: p.default for n, p in sig.parameters.items()}
    assert defaults == {"model": None, "optimizer": None, "objective": None, "windows": None,
                        "ranks": None, "coupled": False}  # fmt: skip


def test_step_stats_is_a_frozen_dataclass_with_the_documented_fields() -> None:
    assert dataclasses.is_dataclass(fb.StepStats)
    fields = {f.name for f in dataclasses.fields(fb.StepStats)}
    assert {"loss", "count", "grad_norm", "skipped", "reason", "steps", "loss_scale"} <= fields
    stats = fb.StepStats(
        loss=1.0,
        count=2.0,
        grad_norm=3.0,
        skipped=False,
        reason=None,
        steps=1,
        loss_scale=0.5,
        lr=0.1,
        micro_batches=2,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.loss = 2.0  # type: ignore[misc]
    assert "loss 1.0000" in str(stats)


def test_loss_signatures() -> None:
    ce = inspect.signature(fb.cross_entropy_sum).parameters
    assert list(ce) == ["logits", "labels", "ignore_index", "shift"]
    assert ce["ignore_index"].default == -100 and ce["shift"].default is False
    lm = inspect.signature(fb.causal_lm_loss).parameters
    assert list(lm) == ["logits", "labels", "ignore_index"]
    ct = inspect.signature(fb.count_tokens).parameters
    assert ct["ignore_index"].default == -100 and ct["shift"].default is True


def test_py_typed_marker_is_shipped() -> None:
    files = importlib.metadata.files("fullbatch") or []
    import pathlib

    package = pathlib.Path(fb.__file__).parent
    assert (package / "py.typed").exists() or any(f.name == "py.typed" for f in files)


def _cli(argv: list[str], capsys) -> tuple[int, str]:
    from fullbatch.cli import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    return info.value.code, capsys.readouterr().out


def test_cli_version(capsys) -> None:
    code, out = _cli(["--version"], capsys)
    assert code == 0
    assert out.strip() == f"fullbatch {fb.__version__}"


def test_cli_help(capsys) -> None:
    code, out = _cli(["--help"], capsys)
    assert code == 0
    assert "usage: fullbatch" in out
    for sub in ("demo", "verify", "probe"):
        assert sub in out

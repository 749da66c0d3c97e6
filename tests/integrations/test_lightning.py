"""``fullbatch.lightning.ExactAccumulation`` against a plain PyTorch full-batch reference.

Every test compares the parameters after *every* optimizer step with one forward/backward of
the window's rows padded together (summed token loss / token count), in float64 unless the
test is about mixed precision. Micro-batches hold different numbers of rows and tokens.
"""

from __future__ import annotations

import copy
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning.pytorch")

import _lightning_cases as cases
from _lightning_cases import LM, fit, max_diff, reference, tiny_lm
from fullbatch.lightning import ExactAccumulation

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

# 10 micro-batches with 1-6 rows each; K=4 gives windows of 4, 4 and a partial 2.
SIZES = [4, 2, 5, 3, 1, 6, 2, 4, 3, 3]
K = 4


def _data(sizes: list[int] = SIZES, k: int = K, seed: int = 1) -> tuple[list[Any], list[Any]]:
    rows = cases.make_rows(sum(sizes), seed=seed)
    batches = cases.micro_batches(rows, sizes)
    windows, start = [], 0
    for w in range(0, len(sizes), k):
        n = sum(sizes[w : w + k])
        windows.append(rows[start : start + n])
        start += n
    return batches, windows


def test_every_step_equals_the_full_batch_including_the_partial_window(tmp_path: Path) -> None:
    batches, windows = _data()
    losses: list[float] = []
    ref = reference(tiny_lm(0).double(), windows, losses=losses)
    cb = ExactAccumulation()
    rec = fit(LM(tiny_lm(0)), batches, k=K, root=str(tmp_path), exact=False, callbacks=[cb])
    assert len(rec.params) == 3  # 4 + 4 + 2 micro-batches
    assert max_diff(rec.params, ref) < 1e-12
    # the logged loss is the true loss of the last (partial) window, over its tokens
    assert cb.steps == 3 and cb.skipped_windows == 0
    assert math.isclose(cb.loss, losses[-1], rel_tol=1e-12)
    assert cb.count == int((cases.pad(windows[-1])["labels"][:, 1:] != -100).sum())


def test_lightning_own_accumulation_of_a_mean_loss_is_off(tmp_path: Path) -> None:
    """The bug the callback fixes: mean of means, and the partial window divided by K."""
    batches, windows = _data()
    ref = reference(tiny_lm(0).double(), windows)
    rec = fit(LM(tiny_lm(0), mean=True), batches, k=K, root=str(tmp_path), exact=False)
    first = max_diff(rec.params[:1], ref[:1])
    assert first > 1e-3, first  # mean of means, already in the first window
    assert max_diff(rec.params, ref) > 5e-3


def test_logged_train_loss(tmp_path: Path) -> None:
    batches, windows = _data(SIZES[:4])
    losses: list[float] = []
    reference(tiny_lm(0).double(), windows, losses=losses)
    cb = ExactAccumulation(log_name="window_loss")
    trainer = cases.pl.Trainer(
        accelerator="cpu",
        precision="64-true",
        max_epochs=1,
        accumulate_grad_batches=K,
        callbacks=[cb],
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(LM(tiny_lm(0)), cases.loader(batches))
    assert math.isclose(float(trainer.callback_metrics["window_loss"]), losses[0], rel_tol=1e-12)


def test_limit_train_batches_and_several_epochs(tmp_path: Path) -> None:
    # 6 of 10 micro-batches per epoch (windows of 4 and 2), the same 6 in each of 2 epochs
    batches, windows = _data(SIZES[:6])
    batches = batches + batches[:4]
    ref = reference(tiny_lm(0).double(), windows * 2)
    rec = fit(LM(tiny_lm(0)), batches, k=K, root=str(tmp_path), epochs=2, limit_train_batches=6)
    assert len(rec.params) == 4
    assert max_diff(rec.params, ref) < 1e-12


def test_gradient_clipping_sees_the_normalized_gradient(tmp_path: Path) -> None:
    batches, windows = _data()
    clip = 0.05
    ref = reference(tiny_lm(0).double(), windows, clip=clip)
    unclipped = reference(tiny_lm(0).double(), windows)
    assert max_diff(ref, unclipped) > 1e-3  # the clip is active
    rec = fit(LM(tiny_lm(0)), batches, k=K, root=str(tmp_path), gradient_clip_val=clip)
    assert max_diff(rec.params, ref) < 1e-12


def test_scheduler_steps_once_per_window(tmp_path: Path) -> None:
    batches, windows = _data()
    ref = reference(tiny_lm(0).double(), windows, gamma=0.5)
    rec = fit(LM(tiny_lm(0), scheduler=True), batches, k=K, root=str(tmp_path))
    assert max_diff(rec.params, ref) < 1e-12


def test_gradient_accumulation_scheduler(tmp_path: Path) -> None:
    """K from Lightning's GradientAccumulationScheduler: 4 in epoch 0, 2 in epoch 1."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    sizes = SIZES[:6]
    batches, windows4 = _data(sizes, 4)
    _, windows2 = _data(sizes, 2)
    ref = reference(tiny_lm(0).double(), windows4 + windows2)
    sched = GradientAccumulationScheduler({0: 4, 1: 2})
    rec = fit(
        LM(tiny_lm(0)),
        batches,
        k=1,
        root=str(tmp_path),
        epochs=2,
        callbacks=[sched],
    )
    assert len(rec.params) == 2 + 3
    assert max_diff(rec.params, ref) < 1e-12


def test_tiny_llama(tmp_path: Path) -> None:
    from fullbatch._demo._corpus import read_corpus
    from fullbatch._demo._model import tiny_llama

    # transformers' LlamaRMSNorm normalizes in float32 even in a float64 model, so backward
    # rounding is float32-like where it passes there: ~1e-9 here (the callback scales the
    # gradient after backward, the reference divides the loss before it); the grad the
    # optimizer receives equals the same model's full-batch sum / N to 2e-16.
    loaded = tiny_llama(seed=0, max_length=64, dtype=torch.float64)
    rows = [torch.tensor(r) for r in read_corpus(12, seed=0, encode=loaded.encode).rows]
    sizes = [3, 1, 4, 2, 2]  # windows of 4 micro-batches (10 rows) and 1 (2 rows)
    batches = cases.micro_batches(rows, sizes)
    windows = [rows[:10], rows[10:]]
    net = loaded.model.train()
    ref = reference(copy.deepcopy(net), windows)
    rec = fit(LM(net), batches, k=K, root=str(tmp_path))
    assert max_diff(rec.params, ref) < 1e-8
    plain = fit(LM(copy.deepcopy(net)), batches, k=K, root=str(tmp_path), exact=False)
    assert max_diff(plain.params, ref) > 1e-4  # (a sum loss under Lightning's own division)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision(tmp_path: Path, precision: str) -> None:
    """float32 parameters, autocast; "16-mixed" on CPU through an explicit GradScaler."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    batches, windows = _data()
    dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float16
    ref = reference(tiny_lm(0), windows, autocast=dtype)  # full batch, same autocast
    if precision == "bf16-mixed":
        how: dict[str, Any] = {"precision": precision}
    else:  # Lightning turns "16-mixed" on CPU into bf16; the plugin keeps fp16 + GradScaler
        scaler = torch.amp.GradScaler("cpu")
        how = {"precision": None, "plugins": [MixedPrecision("16-mixed", "cpu", scaler=scaler)]}
    rec = fit(LM(tiny_lm(0)), batches, k=K, root=str(tmp_path), **how)
    plain = fit(LM(tiny_lm(0), mean=True), batches, k=K, root=str(tmp_path), exact=False, **how)
    if precision == "16-mixed":
        assert scaler.get_scale() == 2.0**16  # no overflow, no skipped step
    err, plain_err = max_diff(rec.params, ref), max_diff(plain.params, ref)
    assert err < 2e-4, err  # rounding of a low-precision forward, not a different objective
    assert plain_err > 20 * err


# -- zero counts and dropped micro-batches -----------------------------------------------


def test_window_with_zero_items_is_skipped_with_a_warning(tmp_path: Path) -> None:
    batches, windows = _data(SIZES[:8])
    for b in batches[4:8]:  # the second window has no target at all
        b["labels"].fill_(-100)
    ref = reference(tiny_lm(0).double(), windows[:1])
    cb = ExactAccumulation()
    with pytest.warns(
        RuntimeWarning, match="window 1 was skipped \\(no items counted in the window\\)"
    ):
        rec = fit(LM(tiny_lm(0)), batches, k=K, root=str(tmp_path), exact=False, callbacks=[cb])
    assert cb.skipped_windows == 1 and math.isnan(cb.loss)
    assert max_diff(rec.params[:1], ref) < 1e-12
    assert max_diff(rec.params[1:], rec.params[:1]) == 0.0  # the second step changed nothing


def test_skipped_window_leaves_the_step_scheduler_where_it_was(tmp_path: Path) -> None:
    """StepLR (gamma 0.5 per step): window 3 steps with the LR window 2 would have used."""
    batches, windows = _data(SIZES[:8] + SIZES[:4])
    for b in batches[4:8]:  # the second window has no target at all
        b["labels"].fill_(-100)
    ref = reference(tiny_lm(0).double(), [windows[0], windows[2]], gamma=0.5)
    with pytest.warns(RuntimeWarning, match="window 1 was skipped"):
        rec = fit(LM(tiny_lm(0), scheduler=True), batches, k=K, root=str(tmp_path))
    assert len(rec.params) == 3
    assert max_diff(rec.params[:1], ref[:1]) < 1e-12
    assert max_diff(rec.params[1:2], rec.params[:1]) == 0.0
    # lr 0.05 at window 3, as if window 2 never existed (0.025 had the scheduler stepped)
    assert max_diff(rec.params[2:], ref[1:]) < 1e-12


def test_micro_batch_with_zero_items_counts_nothing(tmp_path: Path) -> None:
    rows = cases.make_rows(9, seed=3)
    rows[4:6] = [torch.tensor([5]), torch.tensor([7])]  # 1-token rows: nothing to predict
    batches = cases.micro_batches(rows, [4, 2, 3])
    assert int((batches[1]["labels"][:, 1:] != -100).sum()) == 0
    ref = reference(tiny_lm(0).double(), [rows])
    rec = fit(LM(tiny_lm(0)), batches, k=K, root=str(tmp_path))
    assert max_diff(rec.params, ref) < 1e-12


def test_epoch_cut_short_warns_about_the_dropped_micro_batches(tmp_path: Path) -> None:
    class Stopping(LM):
        def on_train_batch_start(self, batch: Any, batch_idx: int) -> Any:
            return -1 if batch_idx == 5 and self.current_epoch == 0 else None

    batches, windows = _data()  # epoch 0: window 1, then micro-batch 4 is dropped
    ref = reference(tiny_lm(0).double(), windows[:1] + windows)
    with pytest.warns(RuntimeWarning, match="1 micro-batch\\(es\\) were accumulated but never"):
        rec = fit(Stopping(tiny_lm(0)), batches, k=K, root=str(tmp_path), epochs=2)
    assert max_diff(rec.params, ref) < 1e-12


# -- mistakes raise with the fix ---------------------------------------------------------


def _fit_raises(tmp_path: Path, module: LM, match: str, **kw: Any) -> None:
    batches, _ = _data(SIZES[:4])
    with pytest.raises(ValueError, match=match):
        fit(module, batches, k=kw.pop("k", K), root=str(tmp_path), **kw)


def test_a_mean_tensor_raises(tmp_path: Path) -> None:
    _fit_raises(tmp_path, LM(tiny_lm(0), mean=True), 'returned a tensor.*"count": n')


def test_a_dict_without_count_raises(tmp_path: Path) -> None:
    module = LM(tiny_lm(0), step_output=lambda s, n: {"loss": s / n})
    _fit_raises(tmp_path, module, r"returned \['loss'\].*both keys")


@pytest.mark.parametrize(
    "count", [-1, math.inf, torch.tensor(-2.0), torch.tensor(float("nan"))], ids=str
)
def test_a_bad_count_raises(tmp_path: Path, count: Any) -> None:
    module = LM(tiny_lm(0), step_output=lambda s, n: {"loss": s, "count": count})
    _fit_raises(tmp_path, module, "negative or not finite|finite number >= 0")


def test_k_changed_inside_a_window_raises(tmp_path: Path) -> None:
    """K set from 4 to 2 at the window's second micro-batch: the first was divided by 4."""

    class ChangeK(cases.pl.Callback):
        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == 0 and args[-1] == 1:
                trainer.accumulate_grad_batches = 2

    batches, _ = _data(SIZES[:4])
    module = LM(tiny_lm(0))
    with pytest.raises(RuntimeError, match=r"accumulate_grad_batches changed inside a window"):
        fit(module, batches, k=K, root=str(tmp_path), callbacks=[ChangeK()])


def test_manual_optimization_is_refused(tmp_path: Path) -> None:
    class Manual(LM):
        def __init__(self) -> None:
            super().__init__(tiny_lm(0))
            self.automatic_optimization = False

    _fit_raises(tmp_path, Manual(), "automatic optimization only", k=1)


def test_an_accumulation_schedule_dict_is_refused(tmp_path: Path) -> None:
    _fit_raises(tmp_path, LM(tiny_lm(0)), "GradientAccumulationScheduler", k={0: 2})


def test_grad_divisor_is_validated() -> None:
    with pytest.raises(ValueError, match="grad_divisor must be a finite number > 0, got 0"):
        ExactAccumulation(grad_divisor=0)


def test_callback_leaves_the_module_class_untouched(tmp_path: Path) -> None:
    batches, _ = _data(SIZES[:4])
    module = LM(tiny_lm(0))
    fit(module, batches, k=K, root=str(tmp_path))
    assert "training_step" not in vars(module)  # the instance attribute is gone after fit


def test_import_fullbatch_does_not_import_the_frameworks() -> None:
    code = (
        "import sys, fullbatch; fullbatch.Accumulator; fullbatch.verify\n"
        "frameworks = ('lightning', 'pytorch_lightning', 'transformers', 'accelerate')\n"
        "found = sorted(m for m in sys.modules if m.split('.')[0] in frameworks)\n"
        "print(found)\n"
        "assert not found, found"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, timeout=60, capture_output=True, text=True
    )
    assert out.stdout.strip() == "[]"


def test_two_callbacks_are_refused(tmp_path: Path) -> None:
    _fit_raises(
        tmp_path, LM(tiny_lm(0)), "2 ExactAccumulation callbacks", callbacks=[ExactAccumulation()]
    )


def test_a_gradient_reader_listed_first_is_warned_about(tmp_path: Path) -> None:
    class GradNorm(cases.pl.Callback):
        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            pass

    batches, _ = _data(SIZES[:4])
    with pytest.warns(UserWarning, match=r"\['GradNorm'\] come before ExactAccumulation"):
        fit(
            LM(tiny_lm(0)),
            batches,
            k=K,
            root=str(tmp_path),
            exact=False,
            callbacks=[GradNorm(), ExactAccumulation()],
        )


def test_a_non_finite_window_loss_is_skipped_with_a_warning(tmp_path: Path) -> None:
    class InfAt5(LM):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            out = super().training_step(batch, batch_idx)
            if batch_idx == 5:  # second window
                out["loss"] = out["loss"] * math.inf
            return out

    batches, windows = _data(SIZES[:8])
    ref = reference(tiny_lm(0).double(), windows[:1])
    with pytest.warns(RuntimeWarning, match="window 1 was skipped \\(non-finite loss\\)"):
        rec = fit(InfAt5(tiny_lm(0)), batches, k=K, root=str(tmp_path))
    assert max_diff(rec.params[:1], ref) < 1e-12
    assert max_diff(rec.params[1:], rec.params[:1]) == 0.0


def test_a_non_finite_gradient_under_a_grad_scaler_is_skipped_and_backs_off(
    tmp_path: Path,
) -> None:
    """fp16 with a GradScaler (CPU plugin): an inf gradient in the second window is skipped by
    the one verdict (parameters unchanged, counted, warned with the GradScaler hint), and the
    scaler still sees it and backs off, as it does in fb.Accumulator."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    class InfGrad(LM):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            self.poison = batch_idx == 5  # second window
            return super().training_step(batch, batch_idx)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            out = super().forward(ids)
            if self.poison:
                out.register_hook(lambda g: torch.full_like(g, math.inf))
            return out

    batches, _ = _data(SIZES[:8])
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    cb = ExactAccumulation()
    how = {"precision": None, "plugins": [MixedPrecision("16-mixed", "cpu", scaler=scaler)]}
    with pytest.warns(RuntimeWarning, match="non-finite gradient.*With a GradScaler"):
        rec = fit(InfGrad(tiny_lm(0)), batches, k=K, root=str(tmp_path), exact=False,
                  callbacks=[cb], **how)  # fmt: skip
    assert (cb.steps, cb.skipped_windows, cb.windows) == (1, 1, 2)
    assert max_diff(rec.params[1:], rec.params[:1]) == 0.0
    assert scaler.get_scale() == 2.0**9  # backed off once


def _setup_with(strategy: Any, cb: ExactAccumulation | None = None) -> None:
    """Call the callback's setup with a stand-in Trainer holding ``strategy``."""
    from types import SimpleNamespace

    cb = cb or ExactAccumulation()
    trainer = SimpleNamespace(accumulate_grad_batches=2, strategy=strategy, callbacks=[cb])
    cb.setup(trainer, LM(tiny_lm(0)), "fit")  # type: ignore[arg-type]


def test_an_unknown_strategy_is_refused() -> None:
    from lightning.pytorch.strategies import FSDPStrategy

    with pytest.raises(ValueError, match="DDP strategies, not FSDPStrategy"):
        _setup_with(FSDPStrategy())


def test_a_ddp_comm_hook_needs_grad_divisor() -> None:
    from lightning.pytorch.strategies import DDPStrategy

    def my_hook(state: Any, bucket: Any) -> Any:
        return bucket

    with pytest.raises(ValueError, match=r"ddp_comm_hook='my_hook'.*grad_divisor=D"):
        _setup_with(DDPStrategy(ddp_comm_hook=my_hook))
    _setup_with(DDPStrategy(ddp_comm_hook=my_hook), ExactAccumulation(grad_divisor=2))  # accepted


@pytest.mark.parametrize("package", cases.PACKAGES)
def test_either_packages_trainer_steps_the_full_batch(tmp_path: Path, package: str) -> None:
    """With both `lightning` and `pytorch_lightning` installed, the callback follows the
    Trainer it runs in: a `pytorch_lightning.Trainer` is exact too (it used to be refused as
    "not SingleDeviceStrategy", comparing with lightning.pytorch's classes)."""
    pytest.importorskip(package)
    batches, windows = _data()
    ref = reference(tiny_lm(0).double(), windows)
    cb = ExactAccumulation()
    module = cases.lm_class(package)(tiny_lm(0))
    rec = fit(module, batches, k=K, root=str(tmp_path), exact=False, callbacks=[cb],
              package=package)  # fmt: skip
    assert cb.steps == 3 and len(rec.params) == 3
    assert max_diff(rec.params, ref) < 1e-12


@pytest.mark.parametrize("package", cases.PACKAGES)
def test_strategies_are_taken_from_the_trainers_package(package: str) -> None:
    from types import SimpleNamespace

    strategies = pytest.importorskip(f"{package}.strategies")
    # a user's Trainer subclass, defined outside Lightning: its base class names the package
    base = type("Trainer", (SimpleNamespace,), {"__module__": f"{package}.trainer.trainer"})
    user_trainer = type("MyTrainer", (base,), {"__module__": "my_project.train"})
    module = cases.lm_class(package)(tiny_lm(0))
    cb = ExactAccumulation()
    trainer = user_trainer(
        accumulate_grad_batches=2, strategy=strategies.SingleDeviceStrategy("cpu"), callbacks=[cb]
    )
    cb.setup(trainer, module, "fit")  # type: ignore[arg-type]
    assert cb._ddp is strategies.DDPStrategy
    cb.teardown(trainer, module, "fit")  # type: ignore[arg-type]
    trainer.strategy = strategies.FSDPStrategy()
    with pytest.raises(
        ValueError, match=rf"not FSDPStrategy \(from {package}\..*{package}\.Trainer"
    ):
        cb.setup(trainer, module, "fit")  # type: ignore[arg-type]
    assert "training_step" not in vars(module)

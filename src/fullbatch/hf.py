"""Exact gradient accumulation for the Hugging Face ``Trainer``, whatever the head does.

The stock ``Trainer(gradient_accumulation_steps=K)`` is exact only when the model's forward
consumes ``num_items_in_batch``. Many heads accept ``**kwargs`` and drop it (BERT's masked-LM and
sequence-classification heads take a plain per-micro-batch mean), and the Trainer then believes
the loss is already scaled: the step gets roughly ``K`` times the full-batch gradient, with
micro-batches weighted equally instead of by their item counts. :class:`ExactTrainer` owns the
loss instead:

- it computes the loss *sum* and the item count of every micro-batch from the logits and the
  labels (the head's own loss is not computed: ``labels`` are withheld from the model);
- it backpropagates ``c · loss_sum``, with ``c`` one number identical on every rank (a power
  of two ``<= 1 / N`` of the previous window), and after the window's last backward (gradients
  already summed over micro-batches and averaged over DDP ranks) multiplies the gradients by
  ``W / (c · N)``, where ``N`` is the window's item count over all micro-batches and all ranks
  (one small all-reduce) and ``W`` the number of DDP ranks. Clipping,
  ``on_pre_optimizer_step`` callbacks and the optimizer therefore see the full-batch gradient;
- a window with no counted items, a non-finite loss or a non-finite gradient is skipped, as
  ``fb.Accumulator`` skips it: parameters, optimizer state and the LR schedule stay as they
  were, a ``RuntimeWarning`` says so (at the 1st, 2nd, 4th, ... skip) and
  ``trainer.fb_counters`` counts optimizer steps and skipped windows (``state.global_step``
  counts both);
- the partial last window of an epoch is normalized by its own count;
- the logged training loss is the true loss of each window (loss sum over ``N``), averaged over
  the windows of the logging interval. ``num_items_in_batch``, ``model_accepts_loss_kwargs``
  and ``average_tokens_across_devices`` play no part.

Loss kinds (``loss=``), the declared objectives of ``fb.probe`` and ``fb.verify``:
``"causal_lm"`` (next-token, labels aligned with the inputs, shifted here; a batch's
``shift_labels`` are used as they are), ``"token"`` (token targets, no shift: masked LM and
token classification), ``"sample"`` (one label per row: an integer class, or a float target
under squared error), ``"seq2seq"`` (encoder-decoders such as T5 and BART: ``"token"`` on the
decoder targets, ``decoder_input_ids`` built from the labels as the model builds them), or a
function ``fn(outputs, labels) -> (loss_sum, count)``. ``-100`` labels are never counted.
(``"masked_lm"`` and ``"classification"``, the names of earlier releases, are refused with the
name to use.)

:func:`check_trainer` runs a configured Trainer on copies, one window accumulated against the
same rows as one full batch, and says whether its accumulation is exact.

>>> import fullbatch.hf
>>> fullbatch.hf.ExactTrainer.__mro__[1].__name__
'Trainer'
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

try:
    from transformers import Trainer
except ImportError as exc:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        'fullbatch.hf needs transformers and accelerate: pip install "fullbatch[hf]"'
    ) from exc

from fullbatch._base._close import read_totals
from fullbatch._base._losses import count_tokens
from fullbatch._base._normalize import check_count
from fullbatch._base._schedule import KeptSchedule
from fullbatch._base._verdict import WindowCounters, WindowTotals
from fullbatch._base._versions import trainer_parallel_size
from fullbatch._hf_seq2seq import check_kind, with_decoder_inputs
from fullbatch._hf_window import KeepSchedule, end_deepspeed_window, end_trainer_window
from fullbatch._proof._objective import OBJECTIVES, head_objective, logits_of, objective_loss

if TYPE_CHECKING:
    from fullbatch._verify._hf_check import TrainerCheck, check_trainer

__all__ = ["LOSS_KINDS", "ExactTrainer", "LossFn", "TrainerCheck", "check_trainer"]

LossFn = Callable[[Any, torch.Tensor], tuple[torch.Tensor, Any]]
#: The declared objectives of ``fb.probe`` and ``fb.verify`` (one vocabulary), and
#: ``"seq2seq"``: ``"token"`` on an encoder-decoder's decoder targets.
LOSS_KINDS = (*OBJECTIVES, "seq2seq")
#: Spellings of earlier releases, refused with the name to use.
_RENAMED = {"masked_lm": "token", "classification": "sample"}


def _kind_loss(kind: str, outputs: Any, labels: torch.Tensor, shifted: bool) -> tuple[Any, Any]:
    logits = logits_of(
        outputs, fix="pass loss=fn(outputs, labels) -> (loss_sum, count) to ExactTrainer"
    )
    objective = "token" if kind == "seq2seq" else kind
    return objective_loss(objective, logits, labels, shifted=shifted, arg="loss")


class ExactTrainer(Trainer):
    """A ``transformers.Trainer`` whose accumulated steps equal the full-batch step.

    Use it where you would use ``Trainer``, with the same arguments plus ``loss=``; every
    ``TrainingArguments`` option that does not change the loss keeps its meaning
    (``gradient_accumulation_steps``, ``max_grad_norm``, schedulers, callbacks, DDP).

    Args:
        *args, **kwargs: what ``Trainer`` takes.
        loss: ``"causal_lm"``, ``"token"``, ``"sample"``, ``"seq2seq"``, or
            ``fn(outputs, labels) -> (loss_sum, count)``: the loss *summed* over the
            micro-batch's items and how many items that is (``fb.cross_entropy_sum``).
            Required unless a subclass overrides :meth:`exact_loss`.

    Raises:
        ValueError: an unknown ``loss``; a built-in kind that does not fit the model's head
            (e.g. ``"token"`` on a causal LM); settings whose loss scaling this class would
            silently override (``compute_loss_func``, ``label_smoothing_factor``,
            DataParallel over several GPUs, FSDP, tensor/context parallelism, LOMO
            optimizers); a DeepSpeed config at ZeRO stage 0 or whose ``gradient_clipping``
            differs from ``max_grad_norm`` (ZeRO 1-3 are exact: each window is counted
            before its forward, :meth:`exact_count`); at the first micro-batch, missing
            ``labels`` or labels whose shape does not fit the kind.
        TypeError: a class that overrides ``compute_loss`` (it would not be called for
            training) without an ``exact_loss`` that replaces it.

    Any other Trainer subclass: ``class Exact(ExactTrainer, YourTrainer)`` and override
    :meth:`exact_loss` with what ``YourTrainer.compute_loss`` computes, as a sum over the
    micro-batch's items and their count; ``YourTrainer``'s other methods stay as they are.

    Example (tiny classifier; ``check_trainer`` proves the step equals the full batch):

    >>> import torch, tempfile
    >>> from transformers import BertConfig, BertForSequenceClassification, TrainingArguments
    >>> import fullbatch.hf
    >>> config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
    ...     num_attention_heads=2, intermediate_size=32, num_labels=3)
    >>> model = BertForSequenceClassification(config)
    >>> rows = [{"input_ids": torch.tensor([1, 2 + i % 7]), "labels": torch.tensor(i % 3)}
    ...     for i in range(8)]
    >>> args = TrainingArguments(tempfile.mkdtemp(), per_device_train_batch_size=2,
    ...     gradient_accumulation_steps=4, use_cpu=True, report_to=[], save_strategy="no",
    ...     disable_tqdm=True)
    >>> trainer = fullbatch.hf.ExactTrainer(model=model, args=args, train_dataset=rows,
    ...     loss="sample")
    >>> fullbatch.hf.check_trainer(trainer).passed
    True
    """

    #: What this route is called, for ``fb.probe`` (a declaration: see
    #: ``fullbatch._probe._engines``).
    fullbatch_route = "fullbatch.hf.ExactTrainer"

    def __init__(self, *args: Any, loss: str | LossFn | None = None, **kwargs: Any) -> None:
        overridden = type(self).exact_loss is not ExactTrainer.exact_loss
        if loss is None and not overridden:
            raise ValueError(
                f"{type(self).__name__} needs loss=: one of {LOSS_KINDS} or a function "
                "fn(outputs, labels) -> (loss_sum, count) (or a subclass overriding exact_loss)."
            )
        if isinstance(loss, str) and loss in _RENAMED:
            raise ValueError(
                f"loss={loss!r} is now spelled loss={_RENAMED[loss]!r} (the objective names "
                "fb.probe and fb.verify use); same loss, same count."
            )
        if loss is not None and not callable(loss) and loss not in LOSS_KINDS:
            raise ValueError(
                f"loss={loss!r} is not one of {LOSS_KINDS} nor a function "
                "fn(outputs, labels) -> (loss_sum, count)."
            )
        cls = type(self)
        mro = cls.__mro__
        owner = next(c for c in mro if "compute_loss" in c.__dict__)
        exact_owner = next(c for c in mro if "exact_loss" in c.__dict__)
        if owner is not Trainer and (
            exact_owner is ExactTrainer or mro.index(owner) < mro.index(exact_owner)
        ):
            raise TypeError(
                f"{cls.__name__} overrides compute_loss (in {owner.__name__}), which ExactTrainer "
                "never calls for training. Keep what it adds by overriding "
                "exact_loss(self, model, inputs) -> (loss_sum, count) in your class (the loss "
                "summed over the micro-batch's items, not a mean), or move the loss into "
                "loss=fn(outputs, labels) -> (loss_sum, count). See docs/integrations_trl.md "
                "('Any other Trainer subclass')."
            )
        super().__init__(*args, **kwargs)
        self.fb_loss = loss
        # c: a power of two <= 1 / N of the previous window, identical on every rank
        self._fb_c = 1.0
        self._fb_window: list[Any] = []  # the count and loss sum of this window, device tensors
        self._fb_left = 0  # micro-batches of the current window not yet run
        self.fb_counters = WindowCounters()  # optimizer steps taken, windows skipped
        self._fb_schedule: KeptSchedule | None = None  # a skip's LR schedule (KeepSchedule)
        self.add_callback(KeepSchedule(self))
        self._check_settings()

    def _check_settings(self) -> None:
        args = self.args
        fights = {
            "compute_loss_func": "pass it as loss=fn(outputs, labels) -> (loss_sum, count)"
            if self.compute_loss_func is not None
            else None,
            f"label_smoothing_factor={args.label_smoothing_factor}": "write the smoothed loss "
            "as loss=fn(outputs, labels) -> (loss_sum, count)"
            if args.label_smoothing_factor
            else None,
            f"n_gpu={args.n_gpu} (DataParallel)": "launch one process per GPU (torchrun)"
            if args.n_gpu > 1
            else None,
            "deepspeed with loss=fn": "under DeepSpeed the window is counted before its "
            "forward; override exact_count(inputs) in a subclass to give the count"
            if args.deepspeed and callable(self.fb_loss) and not self._counts_up_front()
            else None,
            "fsdp": "FSDP is not supported by ExactTrainer yet; use DDP" if args.fsdp else None,
            f"optim={args.optim}": "use another optimizer (LOMO backpropagates itself)"
            if "lomo" in str(args.optim).lower()
            else None,
            "tensor/context/sequence parallelism": "use plain data parallelism"
            if trainer_parallel_size(self) > 1  # get_cp/sp_size: absent in older transformers
            else None,
        }
        for setting, fix in fights.items():
            if fix is not None:
                raise ValueError(
                    f"ExactTrainer normalizes the loss itself and cannot be combined with "
                    f"{setting}: {fix}."
                )
        if args.deepspeed:
            from fullbatch._hf_deepspeed import check_config

            check_config(type(self).__name__, args)
        if callable(self.fb_loss) or self.fb_loss is None:
            return
        check_kind(self.fb_loss, self.accelerator.unwrap_model(self.model))
        head = getattr(self.accelerator.unwrap_model(self.model), "loss_type", None)
        fit = head_objective(head) if isinstance(head, str) else None
        if self.fb_loss != "seq2seq" and fit is not None and fit != self.fb_loss:
            raise ValueError(
                f"loss={self.fb_loss!r} does not fit {type(self.model).__name__} (a {head} "
                f"head); pass loss={fit!r}."
            )

    def get_batch_samples(
        self, epoch_iterator: Iterator[Any], num_batches: int, device: torch.device
    ) -> tuple[list[Any], None]:
        """Read the next window's micro-batches (no counting here: counts come from the loss)."""
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        self._fb_left = len(batches)
        self._fb_window = []
        if self.is_deepspeed_enabled:  # the engine steps inside the last backward: count now
            from fullbatch._hf_deepspeed import window_scale

            self._fb_upfront = [float(check_count(self.exact_count(b))) for b in batches]
            world = self.accelerator.num_processes
            reduce = (lambda t: self.accelerator.reduce(t, reduction="sum")) if world > 1 else None
            self._fb_n, self._fb_c = window_scale(self._fb_upfront, reduce, world, self.args.device)
        return batches, None

    def _counts_up_front(self) -> bool:
        return type(self).exact_count is not ExactTrainer.exact_count

    def exact_count(self, inputs: dict[str, Any]) -> Any:
        """The items ``exact_loss`` will sum for this micro-batch, from its labels, before the
        forward (used under DeepSpeed, whose engine steps inside the window's last backward).
        A subclass with its own ``exact_loss`` overrides it."""
        if callable(self.fb_loss) or "labels" not in inputs:
            raise ValueError(
                "under DeepSpeed ExactTrainer counts each micro-batch before its forward, from "
                "its 'labels'; with loss=fn or without labels, override exact_count(inputs)."
            )
        if self.fb_loss == "causal_lm" and inputs.get("shift_labels") is not None:
            return count_tokens(inputs["shift_labels"], shift=False)
        return count_tokens(inputs["labels"], shift=self.fb_loss == "causal_lm")

    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        """Forward and backward of one micro-batch; after the window's last, normalize gradients.

        Returns the window's loss (sum over count, all ranks) on its last micro-batch and 0 on
        the others, so the Trainer's logged loss is the mean of true window losses.
        """
        if self._fb_left <= 0:
            raise RuntimeError(
                "ExactTrainer.training_step ran outside a window: the Trainer's loop reads each "
                "window with get_batch_samples first. Call trainer.train(), or "
                "get_batch_samples(...) before the window's training_step calls."
            )
        self._fb_left -= 1
        last = self._fb_left == 0
        if self.accelerator.sync_gradients != last:
            raise RuntimeError(
                f"the Trainer syncs gradients at micro-batch {'not ' if last else ''}ending the "
                "window ExactTrainer read: the loop and get_batch_samples disagree."
            )
        model.train()
        optimizer: Any = self.optimizer
        if callable(getattr(optimizer, "train", None)):  # schedule-free optimizers
            optimizer.train()
        inputs = dict(self._prepare_inputs(inputs))
        with self.compute_loss_context_manager():
            loss_sum, count = self.exact_loss(model, inputs)
        loss_sum, count = self._validated(loss_sum, count)
        stats = [loss_sum.detach().double().reshape(1), count.reshape(1), *self._micro_stats()]
        self._fb_window.append(torch.cat([s.to(count) for s in stats]))
        if self.is_deepspeed_enabled:
            return self._deepspeed_backward(loss_sum, last)
        self.accelerator.backward(loss_sum * self._fb_c)
        if not last:
            return torch.zeros((), device=self.args.device)
        return self._normalize(model)

    def _deepspeed_backward(self, loss_sum: torch.Tensor, last: bool) -> torch.Tensor:
        """``loss_sum · W / N`` through DeepSpeed (its 1/GA off); the engine steps at the
        window's last micro-batch, which closes the window."""
        from fullbatch._hf_deepspeed import check_counts, scaled

        window = torch.stack(self._fb_window)
        if last:  # the one host sync, before DeepSpeed steps
            check_counts(type(self).__name__, window[:, 1].tolist(), self._fb_upfront)
        self.accelerator.backward(scaled(loss_sum, self._fb_c), scale_wrt_gas=False)
        if not last:
            return torch.zeros((), device=self.args.device)
        totals = window.sum(0)
        if self.accelerator.num_processes > 1:
            totals = self.accelerator.reduce(totals, reduction="sum")
        values = totals.tolist()
        self._window_end(values)
        verdict = end_deepspeed_window(self, self.model_wrapped, values[0], self._fb_n)
        return torch.tensor(verdict.loss, device=self.args.device)

    def exact_loss(self, model: torch.nn.Module, inputs: dict[str, Any]) -> tuple[Any, Any]:
        """The micro-batch's loss *summed* over its items, and how many items that is.

        The default runs ``model`` with the labels withheld and computes ``loss=`` from its
        outputs. A subclass of another Trainer overrides it to keep what that Trainer's
        ``compute_loss`` adds (see ``docs/integrations_trl.md``); ``training_step`` scales,
        backpropagates and normalizes by the window's count.
        """
        if "labels" not in inputs:
            raise ValueError(
                f"the micro-batch has no 'labels' (keys: {sorted(inputs)}); ExactTrainer "
                "computes the loss from them. Make the data collator return 'labels', with -100 "
                "where nothing is predicted."
            )
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        shift_labels = inputs.pop("shift_labels", None)
        if self.fb_loss == "seq2seq":
            inputs = with_decoder_inputs(model, inputs, labels)
        outputs = model(**inputs)
        if callable(self.fb_loss):
            return self.fb_loss(outputs, labels)
        if shift_labels is not None and self.fb_loss == "causal_lm":
            return _kind_loss("causal_lm", outputs, shift_labels, shifted=True)
        assert isinstance(self.fb_loss, str)  # __init__ refuses None without exact_loss
        return _kind_loss(self.fb_loss, outputs, labels, shifted=False)

    def _micro_stats(self) -> list[torch.Tensor]:
        """Extra per-micro-batch sums (float64, 1-dim) summed over the window and all ranks
        with the count in one all-reduce; :meth:`_window_end` receives the totals."""
        return []

    def _window_end(self, totals: list[float]) -> None:
        """Called once per window with ``[loss_sum, count, *extras]`` over all ranks."""

    def _validated(self, loss_sum: Any, count: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(loss_sum, torch.Tensor) or loss_sum.dim() != 0:
            raise ValueError(
                f"the loss must be a 0-dim tensor summed over the micro-batch's items, got "
                f"{type(loss_sum).__name__} of shape {tuple(getattr(loss_sum, 'shape', ()))}."
            )
        checked = check_count(count)  # a tensor on an accelerator is returned unchecked
        return loss_sum, torch.as_tensor(checked, dtype=torch.float64, device=loss_sum.device)

    def _normalize(self, model: torch.nn.Module) -> torch.Tensor:
        """End the window through the verdict: the full-batch gradient, or a skip."""
        totals = torch.stack(self._fb_window).sum(0)
        world = self.accelerator.num_processes
        ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        if world > 1:
            if not ddp:
                raise RuntimeError(
                    f"{world} processes but the model is {type(model).__name__}, not "
                    "DistributedDataParallel: ExactTrainer supports DDP only."
                )
            totals = self.accelerator.reduce(totals, reduction="sum")
        # DDP synced the gradients: every rank's squared norm is the same, read with the totals.
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        *values, sq_total = read_totals(totals, grads)  # the one host sync per window
        self._window_end(values)
        verdict = end_trainer_window(
            self,
            model,
            WindowTotals(
                loss=values[0],
                count=values[1],
                squared_norm=sq_total,
                # DDP averaged over `world` ranks; accelerate divided by its accumulation steps.
                divisor=(world if ddp else 1) * self.accelerator.gradient_accumulation_steps,
                loss_scale=self._fb_c,
            ),
        )
        if verdict.next_loss_scale is not None:
            self._fb_c = verdict.next_loss_scale
        return torch.tensor(verdict.loss, device=self.args.device)


def __getattr__(name: str) -> Any:
    """``check_trainer`` and ``TrainerCheck`` on first use (PEP 562): the check's machinery
    (the Accumulator, the verify arms) is not imported by ``ExactTrainer`` users."""
    if name not in ("TrainerCheck", "check_trainer"):
        raise AttributeError(f"module 'fullbatch.hf' has no attribute {name!r}")
    value = getattr(importlib.import_module("fullbatch._verify._hf_check"), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value

"""``ExactTrainer``: the Hugging Face ``Trainer`` whose accumulated step is the full-batch step
(what it does and why: the package docstring, :mod:`fullbatch.hf`)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch

try:
    from transformers import Trainer
except ImportError as exc:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        'fullbatch.hf needs transformers and accelerate: pip install "fullbatch[hf]"'
    ) from exc

from fullbatch._base._normalize import check_count
from fullbatch._base._verdict import WindowCounters
from fullbatch._base._versions import trainer_parallel_size
from fullbatch._proof._objective import (
    OBJECTIVES,
    canonical,
    head_objective,
    logits_of,
    objective_count,
    objective_loss,
)
from fullbatch.hf._deepspeed import DeepSpeedTrainerWindow
from fullbatch.hf._moe import WindowRouting, moe_aux_of, window_routing
from fullbatch.hf._seq2seq import check_kind, with_decoder_inputs
from fullbatch.hf._settings import refuse_args
from fullbatch.hf._window import KeepSchedule, TrainerWindow, restored, summed

__all__ = ["LOSS_KINDS", "ExactTrainer", "LossFn", "target_count"]

LossFn = Callable[[Any, torch.Tensor], tuple[torch.Tensor, Any]]
#: The declared objectives of ``fb.probe`` and ``fb.verify`` (one vocabulary), and
#: ``"seq2seq"``: ``"token"`` on an encoder-decoder's decoder targets.
LOSS_KINDS = (*OBJECTIVES, "seq2seq")


def _kind_loss(kind: str, outputs: Any, labels: torch.Tensor, shifted: bool) -> tuple[Any, Any]:
    logits = logits_of(
        outputs, fix="pass loss=fn(outputs, labels) -> (loss_sum, count) to ExactTrainer"
    )
    objective = "token" if kind == "seq2seq" else kind
    return objective_loss(objective, logits, labels, shifted=shifted, arg="loss")


def target_count(inputs: dict[str, Any], kind: str) -> float:
    """The items loss kind ``kind`` counts in a micro-batch, from its labels (a causal LM's
    ``shift_labels`` as given), before the forward."""
    shifted = inputs.get("shift_labels") if kind == "causal_lm" else None
    labels = inputs["labels"] if shifted is None else shifted
    objective = "token" if kind == "seq2seq" else kind
    return objective_count(objective, labels, shifted=shifted is not None)


class ExactTrainer(Trainer):
    """A ``transformers.Trainer`` whose accumulated steps equal the full-batch step.

    Use it where you would use ``Trainer``, with the same arguments plus ``loss=``; every
    ``TrainingArguments`` option that does not change the loss keeps its meaning
    (``gradient_accumulation_steps``, ``max_grad_norm``, schedulers, callbacks, DDP, FSDP2,
    DeepSpeed). On a transformers MoE model whose config has ``output_router_logits``, the
    load-balancing loss is the window's, not each micro-batch's (docs/moe.md); the routing
    pre-pass that makes it so is timed in ``trainer.fb_stats_seconds`` (this rank, summed).

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
            DataParallel over several GPUs, FSDP1, tensor/context parallelism, LOMO
            optimizers); a DeepSpeed config whose ``gradient_clipping`` differs from
            ``max_grad_norm``, or fp16/bf16 at ZeRO stage 0 (ZeRO 0-3 are exact otherwise:
            each window is counted before its forward, :meth:`exact_count`); at the first
            micro-batch, missing ``labels`` or labels whose shape does not fit the kind; a
            subclass with its own ``exact_loss`` on a model with a router aux loss.
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
    #: True in a wing whose own ``exact_loss`` adds the window's load-balancing term
    #: (``self._fb_routing``; fullbatch.trl's SFT trainer); other overrides are refused on MoE.
    _fb_adds_router_aux = False

    def __init__(self, *args: Any, loss: str | LossFn | None = None, **kwargs: Any) -> None:
        overridden = type(self).exact_loss is not ExactTrainer.exact_loss
        if loss is None and not overridden:
            raise ValueError(
                f"{type(self).__name__} needs loss=: one of {LOSS_KINDS} or a function "
                "fn(outputs, labels) -> (loss_sum, count) (or a subclass overriding exact_loss)."
            )
        loss = canonical(loss, "loss")  # an earlier release's name: a DeprecationWarning
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
        self._fb_c = 1.0  # c: a power of two <= 1 / N of the previous window, on every rank
        self._fb_window: TrainerWindow | None = None  # the window being run (_window)
        self.fb_counters = WindowCounters()  # optimizer steps taken, windows skipped
        self._fb_schedule: Any = None  # a skip's LR schedule, put back by KeepSchedule
        self.add_callback(KeepSchedule(self._fb_restore_schedule))
        self._fb_routing: WindowRouting | None = None  # the window's MoE routing counts
        self.fb_stats_seconds = 0.0  # the MoE routing pre-passes' time on this rank, summed
        self._check_settings()

    def _check_settings(self) -> None:
        refuse_args(
            type(self).__name__,
            self.args,
            compute_loss_func=self.compute_loss_func,
            uncounted_loss=not isinstance(self.fb_loss, str) and not self._counts_up_front(),
        )
        if trainer_parallel_size(self) > 1:  # get_cp/sp_size: absent in older transformers
            raise ValueError(
                f"{type(self).__name__} normalizes the loss itself and refuses tensor/context/"
                "sequence parallelism: use plain data parallelism."
            )
        if moe_aux_of(self.accelerator.unwrap_model(self.model)) is not None and not (
            type(self).exact_loss is ExactTrainer.exact_loss or self._fb_adds_router_aux
        ):
            raise ValueError(
                f"{type(self).__name__} overrides exact_loss on a model with a router auxiliary "
                "loss (output_router_logits, router_aux_loss_coef): only ExactTrainer's own "
                "exact_loss adds the window's load-balancing term. Set router_aux_loss_coef=0.0 "
                "or output_router_logits=False in the config to train without it."
            )
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
        """Read the next window's micro-batches and open the window (under DeepSpeed, whose
        engine steps inside the last backward, it is counted now: :meth:`exact_count`)."""
        batches = list(itertools.islice(epoch_iterator, num_batches))
        opened = DeepSpeedTrainerWindow if self.is_deepspeed_enabled else TrainerWindow
        self._fb_window = opened(self, batches, self._fb_c)
        self._fb_routing = self._window_routing(batches)
        return batches, None

    def _window_routing(self, batches: list[Any]) -> WindowRouting | None:
        """For a model that adds a router aux loss, the window's routing counts and item
        count, over every micro-batch and rank (a no-grad pre-pass: ``fullbatch.hf._moe``)."""
        model = self.accelerator.unwrap_model(self.model)
        aux = moe_aux_of(model)
        if aux is None or not batches:
            return None
        model.train()
        micro = [dict(self._prepare_inputs(b)) for b in batches]
        routing = window_routing(aux, model, micro, self._items, summed(self))
        self.fb_stats_seconds += routing.seconds
        return routing

    def _items(self, inputs: dict[str, Any], outputs: Any) -> float:
        if callable(self.fb_loss):
            return float(self.fb_loss(outputs, inputs["labels"])[1])
        if self.fb_loss is None:  # a wing with its own exact_loss counts before the forward
            return float(self.exact_count(inputs))
        return target_count(inputs, self.fb_loss)

    def _counts_up_front(self) -> bool:
        return type(self).exact_count is not ExactTrainer.exact_count

    def exact_count(self, inputs: dict[str, Any]) -> Any:
        """The items ``exact_loss`` will sum for this micro-batch, from its labels, before the
        forward (used under DeepSpeed, whose engine steps inside the window's last backward).
        A subclass with its own ``exact_loss`` overrides it."""
        if not isinstance(self.fb_loss, str) or "labels" not in inputs:
            raise ValueError(
                "under DeepSpeed ExactTrainer counts each micro-batch before its forward, from "
                "its 'labels'; with loss=fn or without labels, override exact_count(inputs)."
            )
        return target_count(inputs, self.fb_loss)

    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        """Forward and backward of one micro-batch; the window closes after its last.

        Returns the window's loss (sum over count, all ranks) on its last micro-batch and 0 on
        the others, so the Trainer's logged loss is the mean of true window losses.
        """
        window = self._fb_window if self._fb_window is not None else TrainerWindow(self, [], 1.0)
        window.advance(self.accelerator.sync_gradients)  # raises outside a window
        model.train()
        optimizer: Any = self.optimizer
        if callable(getattr(optimizer, "train", None)):  # schedule-free optimizers
            optimizer.train()
        inputs = dict(self._prepare_inputs(inputs))
        with self.compute_loss_context_manager():
            loss_sum, count = self.exact_loss(model, inputs)
        loss_sum, count = self._validated(loss_sum, count)
        window.record(loss_sum, count, self.exact_micro_stats())
        ended = window.backward(self, model, loss_sum)
        if ended is None:
            return torch.tensor(0.0, device=self.args.device)
        self.exact_window_end(ended.values)
        if ended.kept is not None:
            self._fb_schedule = ended.kept
        if ended.verdict.next_loss_scale is not None:
            self._fb_c = ended.verdict.next_loss_scale
        return torch.tensor(ended.verdict.loss, device=self.args.device)

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
            loss_sum, count = self.fb_loss(outputs, labels)
        elif shift_labels is not None and self.fb_loss == "causal_lm":
            loss_sum, count = _kind_loss("causal_lm", outputs, shift_labels, shifted=True)
        else:
            assert isinstance(self.fb_loss, str)  # __init__ refuses None without exact_loss
            loss_sum, count = _kind_loss(self.fb_loss, outputs, labels, shifted=False)
        if self._fb_routing is not None and model.training:
            loss_sum = loss_sum + self._fb_routing.term(outputs, inputs).to(loss_sum.dtype)
        return loss_sum, count

    def _fb_restore_schedule(self) -> None:
        """Put back the LR schedule a skipped window kept (after the Trainer's scheduler step)."""
        self._fb_schedule = restored(self._fb_schedule)

    def exact_micro_stats(self) -> list[torch.Tensor]:
        """A hook for subclasses: extra per-micro-batch sums (float64, 1-dim), summed over the
        window and all ranks with the count in one all-reduce; :meth:`exact_window_end`
        receives the totals."""
        return []

    def exact_window_end(self, totals: list[float]) -> None:
        """Called once per window with ``[loss_sum, count, *extras]`` over all ranks."""

    def _validated(self, loss_sum: Any, count: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(loss_sum, torch.Tensor) or loss_sum.dim() != 0:
            raise ValueError(
                f"the loss must be a 0-dim tensor summed over the micro-batch's items, got "
                f"{type(loss_sum).__name__} of shape {tuple(getattr(loss_sum, 'shape', ()))}."
            )
        checked = check_count(count)  # a tensor on an accelerator is returned unchecked
        return loss_sum, torch.as_tensor(checked, dtype=torch.float64, device=loss_sum.device)


ExactTrainer.__module__ = "fullbatch.hf"  # its public home: reprs and doctests name it there

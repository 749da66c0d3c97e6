"""``fb.probe`` and ``fullbatch probe``: check any training code's accumulation, unchanged.

Design (read this before adding an engine). A window's check has three parts, each with one
home:

- **the reference** (``_reference``): the declared objective's gradient over the window's
  recorded micro-batches, with ``torch.autograd.grad`` (no ``.grad``, RNG, buffer or reducer
  touched), summed over the ranks; its band run gives the rounding band and a sample of the
  per-coordinate rounding. Where it can (a built-in objective, logits in the output, plain
  parameters: ``_early``) each micro-batch is differentiated at the end of its own forward,
  on the graph the engine will backpropagate through, so no forward runs twice; otherwise the
  window is replayed at ``step()``;
- **the applied gradient** (``_applied``): a small protocol, ``AppliedGradient`` (``params()``,
  ``applied()``, ``leftover()``, ``unsupported()``, the ``claims(seen)`` class method, and
  where an engine differs from plain ``.grad``: ``stepped()``, ``wrt()``, ``replaying()``,
  ``clip()``, ``continues()``; ``Reader`` answers them as most engines do), one class per
  engine, in ``_applied.READERS`` order: ``_applied_deepspeed`` (DeepSpeed ZeRO 0-3, CPU
  offload: its partitions and offload buffers gathered whole, its engine found among
  ``Seen.wrappers``), ``_applied_fsdp`` (FSDP2/HSDP: ``DTensor`` gradients through
  ``full_tensor()``, the reference differentiated against FSDP2's unsharded parameters),
  ``_applied_dtensor`` (tensor-parallel ``DTensor`` parameters, alone or under FSDP2/HSDP:
  gathered the same way, the window's ranks the data dims only; claimed before FSDP2's),
  ``_applied_grad`` (``.grad``: plain modules and DDP; claims the rest). **A new engine is one
  new module with one class implementing the protocol, and one line in ``_applied.READERS``**
  ahead of the ``.grad`` reader. It says whether it claims a window, returns whole gradients
  after the engine's own accumulation scaling, and says why it cannot when it cannot; what the
  reference must know of the engine (what to differentiate, what its hooks move) the reader
  answers, and ``_reference`` asks;
- **the judge** (``_judge``): alone decides ``ok``, the pattern and the sentence from the
  measured numbers (``_measured.Measured``), by the rule in its docstring (error against the
  band's tolerance, and every fitted weight and factor against its own measured precision),
  so the verdict and the diagnosis cannot disagree.

A window is what the optimizers stepped between two micro-batches apply: it opens at the first
optimizer's ``step()`` (the reference, before any parameter moves), every optimizer stepped
before the next micro-batch joins it and is read at its own ``step()`` (``_window.OpenWindow``),
and each optimizer's parameters are judged on their own as well as together. A micro-batch is
a forward whose output reaches a backward (``_capture.micro_batches``). Who stepped is read
from declarations (``_engines``: fullbatch's routes set ``fullbatch_route``; the Accumulator
publishes its clip), never from class names or another module's local variables.

One job per module:

- ``_run``: :func:`probe` and its context manager (hooks in, windows checked, hooks out);
  ``_args``: its arguments checked (windows, the optimizer in its wrapper, ``coupled``);
  ``_failures``: what kept it from checking, each text naming windows as the report does;
- ``_hooks``: the probe's optimizer hooks, all removed right after the last probed step, and
  forward hooks that never split a compiled graph;
- ``_capture``: forward hooks that record each micro-batch (inputs, RNG and autocast state),
  and which forwards reached a backward;
- ``_frames``: the engine's micro-batch and labels around a forward, in the loop's frames;
- ``_engines``: who stepped the optimizer (declared routes, foreign engines by package);
- ``_call_loss``: the declared objective's ``(loss_sum, count)`` per recorded call;
- ``_replay``: one call replayed and differentiated; ``_reference``: the window's reference,
  its band and its sum over ranks; ``_early``: the reference taken on the engine's own
  forwards;
- ``_applied``: the applied-gradient protocol and its readers' registry; ``_applied_grad``:
  the ``.grad`` reader; ``_applied_deepspeed``: DeepSpeed's; ``_applied_fsdp``: FSDP2's;
  ``_applied_dtensor``: tensor parallelism's (alone, FSDP2 x TP, HSDP x TP);
- ``_sample``: the gradient coordinates the weight fit looks at;
- ``_window``: one window from its first optimizer's ``step()``: the reference, each
  optimizer's applied gradient against it; ``_measure``: the window closed over every rank;
- ``_fit``: each micro-batch's weight, the factor, the leftover, and their precisions;
- ``_measured``: what a window's check measured; ``_patterns``: the shapes mistakes leave on
  the weights; ``_judge``: right or wrong, the pattern, the sentence; ``_judge_step``: its rule
  for the rest of the step (a clip on scaled gradients, a configured clip against the applied
  one); ``_fixes``: the fix;
- ``_coupled``: forwards of one loop iteration as one micro-batch of a callable objective
  (one loop value, or its items unpacked: ``for q, k in loader``), and an undeclared loss that
  couples a micro-batch's rows named instead of judged; ``_whole``: a declared coupled
  objective's reference, the objective over the whole window's rows as one batch;
  ``_judge_coupled``: the judge's rule for such a window (right, or ``"coupled loss taken per
  micro-batch"``);
- ``_trainer_objective``: the objective of the trainer that runs (``ExactTrainer``'s
  ``loss=``, TRL's ``SFTTrainer``, TRL's ``DPOTrainer`` through
  ``fullbatch.trl._objective``, imported only then), or a refusal before anything trains
  where the probe cannot compute it (TRL's KTO, ORPO, GRPO, ...);
- ``_clip``: ``clip_grad_norm_`` observed while probing;
- ``_moe_objective``: a transformers MoE model's objective, ``causal_lm+moe`` (inferred or
  declared): the window's routing counts in a pre-pass, each call's cross-entropy plus its
  load-balancing term over the window, and the aux gradients the diagnosis fits; the same for
  a callable objective that declares it (``Routed``: TRL's DPO on a MoE model, ``dpo+moe``);
- ``_window_stat``: a judge input, the share of a window's error an MoE load-balancing loss
  taken per micro-batch explains ("a window statistic taken per micro-batch");
- ``_report``: :class:`ProbeReport`, :class:`WindowCheck`; ``_verdicts``: the report of the
  measured windows, each judged; ``_export``: the report as versioned data (``--json``) and its
  schema; ``_plot``: the report as a picture (``--plot``);
- ``_cli``: the ``fullbatch probe`` command (runs the script under the probe);
  ``_cli_args``: its options, ``--help`` and exit statuses; ``_cli_outcome``: how a run ends
  (the exit status, failures in the command line's words); ``_command``: the Python script or
  module its training command runs (anything else refused).

The package imports nothing heavy itself, so ``fullbatch --help`` can load ``_cli`` without
torch; checking code that does not use ``fb.Accumulator`` never imports the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fullbatch._probe._run import probe

__all__ = ["probe"]


def __getattr__(name: str) -> Any:
    if name == "probe":
        from fullbatch._probe._run import probe

        return probe
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""The engine: one window's life, from the loader item to the optimizer step.

One job per module, in import order (imports run downwards only, tests/package/test_imports.py):

- ``_micro_plan``, ``_step_plan``: the options, parsed once into :class:`MicroBatchPlan` (how
  a loader item becomes micro-batches) and :class:`StepPlan` (scheduler, scaler, clip,
  ``accumulate_dtype``, ``batchnorm``); the sync options are ``_base._sync.SyncPlan``;
- services: ``_hooks`` (window hooks), ``_precision`` (``accumulate_dtype``'s buffers),
  ``_batchnorm`` (window statistics), ``_prepared`` and ``_boosted`` (Accelerate's and
  ColossalAI's wrapped objects; a DeepSpeed engine refused), ``_dcp`` (DCP's own optimizer
  step);
- ``_state`` (:class:`WindowState`) and ``_watch`` (:class:`Watch`, one check of the user's
  loop, told each micro-batch, backward and step; :class:`Watches`, the list built once);
- the checks, each a ``Watch``: ``_guards`` (leftovers of a hand loop), ``_mistakes``
  (migration mistakes), ``_labels`` (labels and counts), ``_route`` (DDP's forward),
  ``_scaled`` (a loss already scaled by a GradScaler),
  ``_loader_checks`` (the loader against the window size); ``_checks`` builds the list;
- ``_core`` (:class:`Engine`: services, plans, watches, counters and the open window, handed
  to every helper);
- a window's life: ``_feed`` (the loader's micro-batches), ``_checkpoint``,
  ``_resume_texts`` and ``_resume_check`` (what a state holds and expects, and the refusal
  every rank raises when it does not fit), ``_start`` (the window-start exchange),
  ``_open`` (opening and ending a window), ``_read`` (the step's one host read), ``_step``
  (the step), ``_run`` and ``_verify_pack`` (``window.run``, the ``pack=True`` checks),
  ``_auto`` (``"auto"`` sizes), ``_coupled`` (``window.run_coupled``), ``_stats_pass``
  (``window.stats``: a window statistic's pre-pass), ``_resume``
  (``state_dict`` / ``load_state_dict``);
- the user's handles: ``_window`` (:class:`Window`), ``_windows`` (``acc.windows(loader)``)
  and ``_accumulator`` (:class:`Accumulator`).
"""

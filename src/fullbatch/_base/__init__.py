"""The leaves: pieces that know nothing of windows or of the Accumulator.

They import nothing from the rest of fullbatch but each other:

- ``_normalize``: the normalization's numbers (``c``, ``W / (c · N)``, counts);
- ``_verdict``: the one decision that ends a window in every wing (skip or step, the factor,
  the clip, the counters and the skip warning);
- ``_sync``: everything that talks to ``torch.distributed`` (a package);
- cutting loader items: ``_split`` (rows), ``_take`` (rows taken on the device),
  ``_sort_trim`` (rows sorted by length and trimmed), ``_widths`` (``pad_to_multiple_of``:
  widths on a grid, padded with each key's own padding), ``_packed`` (rows packed into one
  sequence), ``_row_boundaries`` (does packing respect row boundaries on a model),
  ``_autosize`` (where an ``"auto"`` size stands), ``_rows`` (``fb.row_windows``);
- ``_losses`` (summed losses and counts), ``_moe`` (the MoE load-balancing loss as a window
  statistic: routing counts and one micro-batch's term), ``_routing`` (the MoE routing
  pre-pass of the HF wings and the probe: one float64 row per micro-batch, summed over the
  window and ranks), ``_prepass`` (a window statistic's pre-pass, shared by ``window.stats``
  of the Accumulator and of ``fullbatch.deepspeed``), ``_stats`` (:class:`StepStats`),
  ``_lr`` (``fb.scale_lr``), ``_schedule`` (an LR schedule kept across a skipped step);
- state: ``_rng`` (RNG states), ``_modelstate`` (save and restore a model, or its BatchNorm
  buffers), ``_fingerprint``
  (what a resumed run must find);
- ``_versions`` (torch version gates), ``_deepspeed`` (how a DeepSpeed engine is recognised,
  and the configurations no scale makes exact) and ``_warn`` (warnings at the user's line).
"""

"""The proof core: what ``fb.verify``, ``fb.probe`` and the wings share, once.

It imports nothing from fullbatch but the leaves (:mod:`fullbatch._base`; never the engine:
checking code that does not use the Accumulator must not load it), and nothing heavy but torch:

- ``_objective``: the declared objective, one vocabulary (``"causal_lm"``, ``"token"``,
  ``"sample"`` or ``fn(model, micro) -> (loss_sum, count)``): each micro-batch's
  ``(loss_sum, count)`` from logits and labels, its count alone, a Hugging Face head's
  objective, the logits in a model's output, a callable objective's output checked;
- ``_tolerance``: the rounding band's factor and cap, the dtype floor, the unit roundoff;
- ``_norms``: squared norms and distances of gradient lists in float64, a chunk at a time;
- ``_reorder``: a batch with its rows reversed (the band's "same math, other rounding");
- ``_loader``: ``MODULE:FN`` and ``FILE.py:FN`` on the command line (torch-free).
"""

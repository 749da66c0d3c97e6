"""The leaves: pieces that know nothing of windows or of the Accumulator.

Normalization numbers (``_normalize``), the one decision that ends a window in every wing
(``_verdict``: skip or step, the factor, the counters and the skip warning), everything that
talks to ``torch.distributed``
(``_sync``), cutting rows and packing tokens (``_split``, ``_pack``, ``_autosize``), losses,
step statistics, the learning-rate rule, RNG states and the skipped-window schedule restore.
They import nothing from the rest of fullbatch but each other.
"""

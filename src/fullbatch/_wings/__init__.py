"""The wings' floor: what every framework wing (``fullbatch.hf``, ``fullbatch.trl``,
``fullbatch.lightning``, ``fullbatch.deepspeed``, ``fullbatch.super_gradients``,
``fb.Pipeline``) shares, below the wings and above the leaves.

Modules: ``_window`` (the one wing window: record, count ahead, read, close), ``_close``
(the one window-close: read the totals, decide, scale the gradients or skip the framework's
step), ``_deepspeed`` (what every DeepSpeed route shares: the scale up front, the engine's
close; what cannot be exact is the floor's ``fullbatch._base._deepspeed``). How to write a
wing: docs/wings.md.
"""

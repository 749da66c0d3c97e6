"""The engine: one window's life, from the loader item to the optimizer step.

Options and services (``_options``, ``_core``), the loader's micro-batches (``_feed``), the
loop guard, window hooks, gradient buffers, BatchNorm window statistics, Accelerate's wrapped
optimizer (``_prepared``), the window-start exchange (``_start``), the step (``_step``), the
drivers (``_run``, ``_auto``, ``_coupled``), checkpoints (``_resume``) and, on top, the user's
handles ``Window`` and ``Accumulator``. Imports run downwards only (tests/package/test_imports.py).
"""

"""``fb.verify`` and ``fullbatch verify``: prove on the user's own model that fullbatch is exact.

One job per module:

- ``_run``: :func:`verify` itself (runs the arms, decides the verdict);
- ``_arms``: the gradients compared (full batch, fullbatch's Accumulator, naive ``loss / K``),
  with ``_recorder`` (an optimizer that records the gradient and changes nothing);
- ``_verdict``: from the arms' gradients to the report (errors, diagnosis, notes);
- ``_additivity``: is ``loss_fn`` a sum of per-item terms, and if not, why not;
- ``_declared``: is ``loss_fn``'s count the declared objective's; ``_share``: the share form;
- ``_bn``: which BatchNorm layers ``batchnorm="window"`` makes exact;
- ``_precision``: the dtype compared in and its tolerance (the band's rule is in
  :mod:`fullbatch._proof`, shared with the probe);
- ``_moe``: ``verify(..., moe=True)``: the MoE load-balancing loss, each way to accumulate it
  measured against the full batch on the user's model;
- ``_report``: :class:`VerifyReport` and its readable text;
- ``_pack_run``: ``verify(..., pack=True)``: does padding-free packing respect the row
  boundaries on this model (gradient against a measured band, a leak probe, the cause);
- ``_hf_check`` and ``_isolate``: ``fullbatch.hf.check_trainer`` on a copy that shares
  nothing with the user's model;
- ``_cli``, ``_load``, ``_data``: the ``fullbatch verify`` command, its model and data loading
  (``MODULE:FN`` through :mod:`fullbatch._proof._loader`).

The package imports nothing heavy itself, so ``fullbatch --help`` can load ``_cli`` without
torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fullbatch._verify._report import VerifyReport
    from fullbatch._verify._run import verify

__all__ = ["VerifyReport", "verify"]


def __getattr__(name: str) -> Any:
    if name == "verify":
        from fullbatch._verify._run import verify

        return verify
    if name == "VerifyReport":
        from fullbatch._verify._report import VerifyReport

        return VerifyReport
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

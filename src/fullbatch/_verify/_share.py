"""``fb.verify(..., counts=...)``: check a loss written in the share form.

With ``counts=`` on the Accumulator a loss may be the user's *share* of the global objective,
``loss_sum / window.totals[name]``, backpropagated without a count. verify checks that form:
``loss_fn(model, micro, totals) -> share`` (a 0-dim tensor), and ``counts`` the same
``{name: fn(micro) -> number}`` the Accumulator gets.

- The reference is the whole batch's share under the whole batch's totals (= the objective).
- The fullbatch arm drives the real Accumulator with ``counts=`` and ``window.backward(share)``.
- The other arms (and the additivity check) see the share with the batch's totals held fixed,
  in the count form ``(share * T, n)``, with ``n`` the first count of the micro-batch and
  ``T`` its total: the same objective, additive over rows, and the naive ``loss / K`` recipe
  weighs micro-batches by that count as it would.
- One more check the count form cannot make: a share must scale as ``1 / totals``. A share not
  divided by ``window.totals`` (measured: 299% off in a training run) or divided by its own
  micro-batch's count does not change when the totals double; verify says so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["ShareForm"]

ShareFn = Callable[[nn.Module, Any, dict[str, float]], torch.Tensor]


class ShareForm:
    """A share-form ``loss_fn`` and its ``counts``, with the batch's totals.

    >>> import torch, fullbatch as fb
    >>> model = torch.nn.Linear(2, 3)
    >>> batch = {"x": torch.randn(4, 2), "y": torch.tensor([0, 1, -100, 2])}
    >>> counts = {"n": lambda m: fb.count_tokens(m["y"], shift=False)}
    >>> fn = lambda m, b, t: fb.cross_entropy_sum(m(b["x"]), b["y"])[0] / t["n"]
    >>> form = ShareForm(fn, counts, batch)
    >>> form.totals
    {'n': 3.0}
    """

    def __init__(
        self,
        loss_fn: ShareFn,
        counts: Mapping[str, Callable[[Any], Any]],
        batch: Any,
        *,
        autocast: tuple[str, torch.dtype] | None = None,
    ) -> None:
        if (
            not isinstance(counts, Mapping)
            or not counts
            or not all(callable(fn) for fn in counts.values())
        ):
            raise TypeError(
                f"counts must be a non-empty dict of {{name: fn(micro) -> number}}, as given to "
                f"fb.Accumulator(counts=...), got {counts!r}."
            )
        self.counts = dict(counts)
        self._fn = loss_fn
        self._autocast = autocast
        self.totals = {name: float(fn(batch)) for name, fn in self.counts.items()}

    def share(self, model: nn.Module, micro: Any, totals: Mapping[str, float]) -> torch.Tensor:
        """``loss_fn(model, micro, totals)``, checked to be a 0-dim tensor."""
        context: Any = contextlib.nullcontext()
        if self._autocast is not None:
            context = torch.autocast(self._autocast[0], dtype=self._autocast[1])
        with context:
            out = self._fn(model, micro, dict(totals))
        if not isinstance(out, torch.Tensor) or out.dim() != 0:
            got = f"shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out)
            raise TypeError(
                f"with counts=, loss_fn(model, micro, totals) must return the 0-dim share "
                f"loss_sum / totals[name], got {got}."
            )
        return out

    def count_form(self, model: nn.Module, micro: Any) -> tuple[torch.Tensor, Any]:
        """The share under the batch's totals, as ``(share * T, n)`` (the first count)."""
        name, fn = next(iter(self.counts.items()))
        return self.share(model, micro, self.totals) * self.totals[name], fn(micro)

    def scaling_cause(self, model: nn.Module, batch: Any, tol: float) -> str | None:
        """Why the share does not scale as ``1 / totals`` (``None``: it does)."""
        doubled = {name: 2 * value for name, value in self.totals.items()}
        with torch.no_grad():
            one = float(self.share(model, batch, self.totals))
            two = float(self.share(model, batch, doubled))
        if abs(2 * two - one) <= tol * max(abs(one), 1e-300):
            return None
        return (
            f"the share does not scale as 1 / window.totals: with every total doubled it went "
            f"from {one:.6g} to {two:.6g}, not {one / 2:.6g}. Divide the loss sum by a "
            "window.totals entry (e.g. `loss_sum / totals['tokens']`), not by the micro-batch's "
            "own count nor by nothing; or use the count form, backward(loss_sum, n)"
        )

"""Save and restore everything ``verify`` may touch on the user's model, and disable dropout;
the BatchNorm buffers alone for the engine's pre-pass and "auto" re-runs.

``verify`` runs several forward and backward passes on the user's own model. Afterwards the
model must be exactly as it was: parameters (never written), their ``.grad`` and
``requires_grad``, every module's ``training`` flag, every buffer (BatchNorm running statistics
move in a train-mode forward) and the global RNG state (torch CPU, and CUDA when available).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = [
    "BatchNormBuffers",
    "DropoutOff",
    "ModelSnapshot",
    "batchnorm_modules",
    "disable_dropout",
]

# Float attributes that Hugging Face attention modules pass to a functional dropout
# (e.g. ``LlamaAttention.attention_dropout``): no module to put in eval mode, so set to 0.
_DROPOUT_ATTRIBUTES = ("attention_dropout", "dropout", "dropout_p", "attn_dropout", "dropout_rate")


@dataclass
class ModelSnapshot:
    """What ``verify`` restores on exit; take it with :meth:`capture`, undo with :meth:`restore`.

    Capturing also moves existing gradients aside (``.grad`` becomes ``None``) so that the
    comparison starts from clean gradients; :meth:`restore` puts the same tensors back.

    >>> import torch
    >>> model = torch.nn.BatchNorm1d(2)
    >>> snap = ModelSnapshot.capture(model)
    >>> _ = model(torch.randn(4, 2))          # moves the running statistics
    >>> snap.restore()
    >>> model.running_mean.tolist()
    [0.0, 0.0]
    """

    grads: list[tuple[nn.Parameter, torch.Tensor | None]]
    requires_grad: list[tuple[nn.Parameter, bool]]
    training: list[tuple[nn.Module, bool]]
    buffers: list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]]
    cpu_rng: torch.Tensor
    cuda_rng: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def capture(cls, model: nn.Module) -> ModelSnapshot:
        params = list(model.parameters())
        buffers = [
            (module, name, buf, buf.detach().clone())
            for module in model.modules()
            for name, buf in module.named_buffers(recurse=False)
        ]
        snap = cls(
            grads=[(p, p.grad) for p in params],
            requires_grad=[(p, p.requires_grad) for p in params],
            training=[(m, m.training) for m in model.modules()],
            buffers=buffers,
            cpu_rng=torch.get_rng_state(),
            # CUDA not initialized yet: nothing ran on it, and querying would initialize it
            cuda_rng=torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
        )
        for p in params:
            p.grad = None
        return snap

    def restore_buffers(self) -> None:
        """Put every buffer back to its captured value (and object)."""
        with torch.no_grad():
            for module, name, original, saved in self.buffers:
                original.copy_(saved)
                if getattr(module, name, None) is not original:
                    setattr(module, name, original)

    def restore(self) -> None:
        """Undo every change ``verify`` made; safe to call more than once."""
        self.restore_buffers()
        for module, flag in self.training:
            module.training = flag
        for param, flag in self.requires_grad:
            param.requires_grad_(flag)
        for param, grad in self.grads:
            param.grad = grad
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng:
            torch.cuda.set_rng_state_all(self.cuda_rng)


@dataclass
class DropoutOff:
    """Dropout switched off by :func:`disable_dropout`; :meth:`restore` switches it back."""

    # (name, module, its p, whether it was in train mode)
    modules: list[tuple[str, nn.modules.dropout._DropoutNd, float, bool]] = field(
        default_factory=list
    )
    attributes: list[tuple[str, nn.Module, str, float]] = field(default_factory=list)

    def describe(self) -> list[str]:
        """Human-readable list of what was disabled (empty when nothing was)."""
        lines = [
            f"dropout module {name or '<root>'} ({type(m).__name__}, p={p:g}): p set to 0"
            + (" and put in eval mode" if training else "")
            for name, m, p, training in self.modules
        ]
        lines += [
            f"{name}.{attr} = {value:g} set to 0.0" for name, _, attr, value in self.attributes
        ]
        return lines

    def restore(self) -> None:
        """Put every ``p`` and float attribute back (training flags: ``ModelSnapshot``)."""
        for _, dropout, p, _ in self.modules:
            dropout.p = p
        for _, module, attr, value in self.attributes:
            setattr(module, attr, value)


def disable_dropout(model: nn.Module) -> DropoutOff:
    """Switch dropout off everywhere: ``p = 0`` on every dropout module, eval mode too.

    Eval mode alone is not enough: some modules read ``dropout.p`` and apply it at their own
    training flag (GPT-2's attention: ``F.dropout(p=self.attn_dropout.p,
    training=self.training)``), so ``p`` is set to 0 on every dropout module with ``p > 0``,
    and train-mode ones are also put in eval mode. Float dropout attributes of train-mode
    modules (``LlamaAttention.attention_dropout``) are set to 0. Only real changes are listed.
    Functional dropout with a hard-coded probability cannot be reached this way; ``verify``
    detects it by evaluating the full batch twice.

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5)).train()
    >>> off = disable_dropout(model)
    >>> model[1].training, model[1].p, off.describe()
    (False, 0.0, ['dropout module 1 (Dropout, p=0.5): p set to 0 and put in eval mode'])
    >>> off.restore(); model[1].p
    0.5
    """
    off = DropoutOff()
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            if module.p > 0:
                off.modules.append((name, module, module.p, module.training))
                module.p = 0.0
                module.eval()
            continue
        if not module.training:
            continue
        for attr in _DROPOUT_ATTRIBUTES:
            value = getattr(module, attr, None)
            if isinstance(value, float) and value > 0:
                setattr(module, attr, 0.0)
                off.attributes.append((name or "<root>", module, attr, value))
    return off


def _batchnorms(model: nn.Module, training_only: bool) -> list[tuple[str, nn.Module]]:
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and (m.training or not training_only)
    ]


def batchnorm_modules(model: nn.Module, *, training_only: bool = True) -> list[str]:
    """Names of BatchNorm modules (train-mode ones only by default): they couple rows.

    >>> import torch
    >>> batchnorm_modules(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2)))
    ['1']
    """
    return [name or "<root>" for name, _ in _batchnorms(model, training_only)]


class BatchNormBuffers:
    """The BatchNorm buffers (running statistics) as they are now; :meth:`restore` puts them
    back after forwards that must leave no trace (a pre-pass, an abandoned attempt).

    >>> import torch
    >>> model = torch.nn.BatchNorm1d(2)
    >>> saved = BatchNormBuffers(model, training_only=True)
    >>> _ = model(torch.randn(4, 2))
    >>> saved.restore(); model.running_mean.tolist()
    [0.0, 0.0]
    """

    def __init__(self, model: nn.Module, *, training_only: bool) -> None:
        self.saved = [
            (b, b.detach().clone())
            for _, m in _batchnorms(model, training_only)
            for b in m.buffers(recurse=False)
        ]

    def restore(self) -> None:
        with torch.no_grad():
            for buffer, saved in self.saved:
                buffer.copy_(saved)

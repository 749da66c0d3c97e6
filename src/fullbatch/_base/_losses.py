"""Summed losses and item counts: the two numbers every ``window.backward`` call needs.

Both losses return ``(loss summed over counted items, number of counted items)``. They compute
in ``promote_types(logits.dtype, float32)``: half-precision logits are upcast, float64 stays
float64, so a float64 reference test is really float64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["causal_lm_loss", "count_tokens", "cross_entropy_sum"]


def _shifted(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Position t predicts token t + 1: drop the last logit and the first label.
    return logits[..., :-1, :], labels[..., 1:]


def _check_shapes(logits: torch.Tensor, labels: torch.Tensor) -> None:
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits of shape {tuple(logits.shape)} do not match labels of shape "
            f"{tuple(labels.shape)}: logits must be labels.shape + (num_classes,)."
        )


def _check_not_shifted(logits: torch.Tensor, labels: torch.Tensor) -> None:
    """Refuse ``logits[:, :-1]`` and ``labels[:, 1:]`` given to a loss that shifts them again.

    Told from the views themselves (strides and storage offsets, no data read): the labels
    start at column 1 of rows that are at least one column wider, and the logits start at
    position 0 of rows that are at least one position longer. A model's own logits and a
    collator's labels are never both such views; ``labels[:, 1:]`` alone would not match
    ``logits`` in shape.
    """
    if labels.dim() < 2 or logits.dim() < 3:
        return
    col, row = labels.stride(-1), labels.stride(-2)
    pos, seq = logits.stride(-2), logits.stride(-3)
    if col <= 0 or pos <= 0 or row <= 0 or seq <= 0:
        return
    labels_cut = row >= (labels.shape[-1] + 1) * col and labels.storage_offset() % row == col
    logits_cut = seq >= (logits.shape[-2] + 1) * pos and logits.storage_offset() % seq == 0
    if labels_cut and logits_cut:
        raise ValueError(
            "logits and labels are already shifted: the labels start at column 1 of a wider "
            "tensor (labels[:, 1:]) and the logits stop one position short (logits[:, :-1]), "
            "and fb.causal_lm_loss shifts them again, so every token would be predicted two "
            "positions ahead. Pass the unshifted tensors, `fb.causal_lm_loss(logits, labels)`, "
            "or keep your shift and use `fb.cross_entropy_sum(logits[:, :-1], labels[:, 1:])`, "
            "which does not shift."
        )


def _check_labels(
    labels: torch.Tensor, ignore_index: int, shift: bool, *, by_loss: bool = False
) -> None:
    """Refuse negative labels other than ``ignore_index`` (checked where it costs no sync).

    A ``-1`` usually means ignored targets written for ``ignore_index=-1`` (nanoGPT,
    LLMs-from-scratch): counted as items and out of range for cross-entropy. On CPU the check
    raises this message; on accelerators, and inside ``torch.compile``, it is an asynchronous
    device assertion (a host check would stall the device queue at every micro-batch, and
    break the compiled graph). ``by_loss``: the caller runs ``F.cross_entropy``, which refuses
    such labels itself on CPU (``IndexError``); the message is made only then
    (:func:`_label_error`), so the check costs nothing per micro-batch.
    """
    if labels.is_floating_point() or labels.is_complex():
        raise ValueError(
            f"labels must hold integer class indices, got dtype {labels.dtype}; for soft "
            "targets compute the summed loss yourself and pass its item count."
        )
    if labels.device.type != "cpu" or torch.compiler.is_compiling():
        bad = (labels < 0) & (labels != ignore_index)
        torch._assert_async(~bad.any(), "labels hold negative values other than ignore_index")
        return
    if by_loss:
        return
    error = _label_error(labels, ignore_index, shift)
    if error is not None:
        raise error


def _label_error(labels: torch.Tensor, ignore_index: int, shift: bool) -> ValueError | None:
    """The error for a negative label other than ``ignore_index`` in ``labels``, if any."""
    bad = (labels < 0) & (labels != ignore_index)
    if not bool(bad.any()):
        return None
    value = int(labels[bad][0])
    recipe = (
        "If your targets are already shifted (targets[t] is input[t + 1], as in nanoGPT "
        "and LLMs-from-scratch), use fb.cross_entropy_sum(logits, targets, "
        f"ignore_index={value}) and fb.count_tokens(targets, ignore_index={value}, "
        "shift=False): they do not shift again."
        if shift
        else ""
    )
    return ValueError(
        f"labels contain {value}, which is neither a class index nor "
        f"ignore_index={ignore_index}. If {value} marks ignored targets, pass "
        f"ignore_index={value}. {recipe}".rstrip()
    )


def count_tokens(
    labels: torch.Tensor, ignore_index: int = -100, shift: bool = True
) -> torch.Tensor:
    """Number of labels that a summed loss really contains, as a 0-dim int64 tensor.

    With ``shift=True`` (causal LM) the first label of every row is not predicted and is not
    counted. The result stays on ``labels.device``: no host synchronization.

    >>> import torch, fullbatch as fb
    >>> fb.count_tokens(torch.tensor([[5, 6, -100]]))
    tensor(1)
    """
    _check_labels(labels, ignore_index, shift)
    if shift:
        labels = labels[..., 1:]
    return (labels != ignore_index).sum()


def cross_entropy_sum(
    logits: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    shift: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy summed over non-ignored labels, and how many labels that is.

    For sample classification (``logits`` ``[B, C]``, ``labels`` ``[B]``) and token
    classification or masked-LM encoders (``[B, T, C]`` and ``[B, T]``). With ``shift=True``
    it is :func:`causal_lm_loss`.

    Returns:
        ``(loss_sum, count)``: 0-dim tensors; ``loss_sum`` in
        ``promote_types(logits.dtype, float32)``, ``count`` int64. A micro-batch with every
        label ignored gives ``(0.0, 0)`` with a gradient of zeros, never NaN.

    >>> import torch, fullbatch as fb
    >>> loss_sum, n = fb.cross_entropy_sum(torch.zeros(3, 4), torch.tensor([0, -100, 2]))
    >>> round(loss_sum.item(), 4), n.item()
    (2.7726, 2)
    """
    given = labels
    _check_labels(labels, ignore_index, shift, by_loss=True)
    if shift:
        _check_not_shifted(logits, labels)
        logits, labels = _shifted(logits, labels)
    _check_shapes(logits, labels)
    dtype = torch.promote_types(logits.dtype, torch.float32)
    flat_logits = logits.reshape(-1, logits.shape[-1]).to(dtype)
    flat_labels = labels.reshape(-1)
    try:
        loss_sum = F.cross_entropy(
            flat_logits, flat_labels, ignore_index=ignore_index, reduction="sum"
        )
    except IndexError:  # a target out of range, on CPU: say why if it is a stray negative
        error = _label_error(given, ignore_index, shift)
        if error is None:
            raise
        raise error from None
    return loss_sum, (flat_labels != ignore_index).sum()


def causal_lm_loss(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token cross-entropy of a causal LM, summed, and the number of predicted tokens.

    ``labels`` are aligned with the inputs (as Hugging Face models take them): the shift by one
    happens here. Padding and prompt positions carry ``ignore_index``.

    Raises:
        ValueError: ``logits[:, :-1]`` and ``labels[:, 1:]`` were passed (shifted twice: use
            :func:`cross_entropy_sum` for tensors you shifted yourself), or a label is negative
            and not ``ignore_index``.

    >>> import torch, fullbatch as fb
    >>> logits = torch.zeros(1, 3, 5)
    >>> loss_sum, n = fb.causal_lm_loss(logits, torch.tensor([[1, 2, -100]]))
    >>> n.item()
    1
    """
    return cross_entropy_sum(logits, labels, ignore_index=ignore_index, shift=True)

"""Loss functions on plain ``mx.array`` inputs."""

from __future__ import annotations

import mlx.core as mx

from . import functional as F


def cross_entropy(logits, targets, ignore_index: int | None = None, reduction: str = "mean",
                  label_smoothing: float = 0.0, device=None):
    """Softmax cross-entropy with integer class targets.

    Args:
        logits: ``[..., C]`` unnormalised scores (computed in float32).
        targets: ``[...]`` integer class ids in ``[0, C)`` (or ``ignore_index``).
        ignore_index: targets equal to it add nothing and are not counted in the mean.
        reduction: ``"mean"`` (over counted targets), ``"sum"`` or ``"none"`` (shape of targets).
        label_smoothing: mix the one-hot target with the uniform distribution.
        device: the `Device` whose ``kernels`` picks the implementation (`metalnn.functional.cross_entropy_rows`).
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"cross_entropy: logits {tuple(logits.shape)} need targets of shape "
                         f"{tuple(logits.shape[:-1])}, got {tuple(targets.shape)}")
    if not mx.issubdtype(targets.dtype, mx.integer):
        raise TypeError(f"cross_entropy: targets must be integers, got {targets.dtype}")
    logits = logits.astype(mx.float32)
    safe = targets if ignore_index is None else mx.where(targets == ignore_index, 0, targets)
    loss = F.cross_entropy_rows(logits, safe, label_smoothing, device=device)
    if ignore_index is not None:
        keep = (targets != ignore_index)
        loss = mx.where(keep, loss, 0.0)
        count = mx.maximum(keep.sum(), 1)
    else:
        count = loss.size
    if reduction == "mean":
        return loss.sum() / count
    if reduction == "sum":
        return loss.sum()
    if reduction == "none":
        return loss
    raise ValueError(f"cross_entropy: reduction must be mean, sum or none, got {reduction!r}")


def mse(predictions, targets, reduction: str = "mean"):
    """Mean squared error; shapes must match."""
    if predictions.shape != targets.shape:
        raise ValueError(f"mse: predictions {tuple(predictions.shape)} and targets {tuple(targets.shape)} differ")
    loss = mx.square(predictions - targets)
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    if reduction == "none":
        return loss
    raise ValueError(f"mse: reduction must be mean, sum or none, got {reduction!r}")


def accuracy(logits, targets):
    """Fraction of rows whose arg-max equals the target."""
    return (mx.argmax(logits, axis=-1) == targets).astype(mx.float32).mean()

"""RMS normalisation."""

from __future__ import annotations

import mlx.core as mx

from ..device import resolve


def rms_norm_reference(x, weight, eps: float):
    """``x * rsqrt(mean(x^2, -1) + eps) * weight`` in plain MLX ops (accumulated in float32).

    Args:
        x: ``[..., D]``.
        weight: ``[D]`` or None.
    Returns:
        ``[..., D]`` in ``x.dtype``.
    """
    xf = x.astype(mx.float32)
    y = xf * mx.rsqrt(mx.mean(xf * xf, axis=-1, keepdims=True) + eps)
    y = y.astype(x.dtype)
    if weight is not None:
        y = y * weight.astype(x.dtype)
    return y


def rms_norm(x, weight, eps: float = 1e-5, device=None):
    """RMS-normalise the last axis of ``x`` (``[..., D]``) and scale by ``weight`` (``[D]`` or None).

    Same semantics as ``mx.fast.rms_norm``. Differentiable in ``x`` and ``weight`` on every path.
    """
    device = resolve(device)
    if weight is not None and weight.shape != (x.shape[-1],):
        raise ValueError(f"rms_norm: weight must have shape ({x.shape[-1]},), got {tuple(weight.shape)}")
    if device.kernels == "reference":
        return rms_norm_reference(x, weight, eps)
    from ..kernels import rms_norm as kernel

    return kernel.rms_norm(x, weight, eps, device)


def layer_norm_reference(x, weight, bias, eps: float):
    """``(x - mean) * rsqrt(var + eps) * weight + bias`` over the last axis in plain MLX ops (float32
    statistics). x ``[..., D]``, weight/bias ``[D]`` or None; returns ``[..., D]`` in ``x.dtype``."""
    xf = x.astype(mx.float32)
    mean = mx.mean(xf, axis=-1, keepdims=True)
    var = mx.mean(mx.square(xf - mean), axis=-1, keepdims=True)
    y = ((xf - mean) * mx.rsqrt(var + eps)).astype(x.dtype)
    if weight is not None:
        y = y * weight.astype(x.dtype)
    if bias is not None:
        y = y + bias.astype(x.dtype)
    return y


def layer_norm(x, weight, bias, eps: float = 1e-5, device=None):
    """Layer-normalise the last axis of ``x`` (``[..., D]``): ``mx.fast.layer_norm`` semantics.

    ``"reference"`` devices run plain MLX ops; every other device MLX's fused ``mx.fast.layer_norm``
    (metalnn has no custom kernel for it).
    """
    device = resolve(device)
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and p.shape != (x.shape[-1],):
            raise ValueError(f"layer_norm: {name} must have shape ({x.shape[-1]},), got {tuple(p.shape)}")
    if device.kernels == "reference":
        return layer_norm_reference(x, weight, bias, eps)
    return mx.fast.layer_norm(x, weight, bias, eps)

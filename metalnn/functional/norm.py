"""RMS and layer normalisation."""

from __future__ import annotations

import mlx.core as mx

from ..cpu import fused
from ..device import resolve
from ..kernels import rms_norm as kernels
from ._dispatch import emulator_options, fused_cpu, kernel_backend


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

    Same semantics as ``mx.fast.rms_norm``; differentiable in ``x`` and ``weight``. Implementation by
    ``device.kernels``: ``"reference"`` `rms_norm_reference`; ``"auto"`` ``mx.fast.rms_norm``, on the
    CPU backend for float32 `metalnn.cpu.fused.rms_norm` (one multi-threaded pass forward and one
    backward instead of MLX's chain of single-threaded ops; ``scripts/bench_kernels.py --ops
    rms_norm --cpu-time``, one thread, ``[8, 512, 1024]``: about 10x less CPU time forward+backward
    than ``mx.fast.rms_norm``); ``"metal"``/``"emulate"`` the
    kernels of `metalnn.kernels.rms_norm` (float32/float16/bfloat16, non-empty), else ``"auto"``.
    """
    device = resolve(device)
    if weight is not None and weight.shape != (x.shape[-1],):
        raise ValueError(f"rms_norm: weight must have shape ({x.shape[-1]},), got {tuple(weight.shape)}")
    if device.kernels == "reference":
        return rms_norm_reference(x, weight, eps)
    backend = kernel_backend(device)
    if backend and kernels.supports(x, weight):
        return kernels.rms_norm(x, weight, eps, backend, emulator_options(device))
    if fused_cpu(x, weight):
        return fused.rms_norm(x, weight, eps)
    return mx.fast.rms_norm(x, weight, eps)


def layer_norm_reference(x, weight, bias, eps: float):
    """``(x - mean) * rsqrt(var + eps) * weight + bias`` over the last axis in plain MLX ops
    (statistics in float32; result in ``x.dtype``)."""
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
    """Layer-normalise the last axis of ``x`` (``[..., D]``); ``weight``/``bias`` ``[D]`` or None.

    Same semantics as ``mx.fast.layer_norm``; differentiable in every input. Implementation by
    ``device.kernels``: ``"reference"`` `layer_norm_reference`; every other choice
    ``mx.fast.layer_norm`` (metalnn has no custom kernel for it).
    """
    device = resolve(device)
    for name, a in (("weight", weight), ("bias", bias)):
        if a is not None and a.shape != (x.shape[-1],):
            raise ValueError(f"layer_norm: {name} must have shape ({x.shape[-1]},), got {tuple(a.shape)}")
    if device.kernels == "reference":
        return layer_norm_reference(x, weight, bias, eps)
    return mx.fast.layer_norm(x, weight, bias, eps)

"""RoPE on custom kernels (``metal_kernels/rope.metal``); the backward is the inverse rotation."""

from __future__ import annotations

import mlx.core as mx

from ..functional.rope import rope_frequencies
from .launch import run

FAMILY = "rope"


def _launch(x, dims, traditional, inv_freq, offset, scale, forward, backend, opts):
    T, D = x.shape[-2], x.shape[-1]
    x3 = x.reshape(-1, T, D)
    B = x3.shape[0]
    gx = dims // 2 + (D - dims)
    (y,) = run(FAMILY, "rope", backend, [x3, inv_freq, offset, float(scale), T, D, dims], [x3.shape], [x.dtype],
               grid=(gx, T, B), threadgroup=(min(gx, 64), 1, 1),
               template=[("T", x.dtype), ("TRADITIONAL", bool(traditional)), ("FORWARD", bool(forward))],
               emulator_options=opts)
    return y.reshape(x.shape)


def rope(x, dims, traditional, base, scale, offset, freqs, device):
    """Kernel-backed ``F.rope`` on x ``[..., T, D]``."""
    backend = device.kernels
    opts = getattr(device, "emulator_options", None)
    inv_freq = rope_frequencies(dims, base, freqs)
    offset = offset.astype(mx.int32) if isinstance(offset, mx.array) else int(offset)
    if x.ndim < 2:
        raise ValueError(f"rope: x must be [..., T, D], got shape {tuple(x.shape)}")

    @mx.custom_function
    def fn(x):
        return _launch(x, dims, traditional, inv_freq, offset, scale, True, backend, opts)

    @fn.vjp
    def fn_vjp(primals, cotangent, output):
        return _launch(cotangent.astype(primals[0].dtype), dims, traditional, inv_freq, offset, scale, False,
                       backend, opts)

    return fn(x)

"""RoPE on a custom kernel (``metal_kernels/rope.metal``); the backward is the inverse rotation.

`rope` is an ``mx.custom_function`` built once per backend, ``dims``, ``traditional``, ``scale``
and emulator options. The frequencies and the position offset are inputs (the offset a 0-d int32
array), so decoding step after step reuses the same function and kernel.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from .op_math import rope_frequencies
from . import launch

FAMILY = "rope"
DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def supports(x, dims: int) -> bool:
    """Whether the kernel takes ``x [..., T, D]``: float dtypes, not empty, ``0 < dims <= D`` even."""
    return (x.ndim >= 2 and x.size > 0 and x.dtype in DTYPES and 0 < dims <= x.shape[-1]
            and dims % 2 == 0)


def _rotate(x, inv_freq, offset, dims, traditional, scale, forward, backend, options):
    T, D = x.shape[-2], x.shape[-1]
    x3 = x.reshape(-1, T, D)
    B = x3.shape[0]
    gx = dims // 2 + (D - dims)
    (y,) = launch.run(FAMILY, "rope", backend, [x3, inv_freq, offset, float(scale), T, D, dims], [x3.shape],
                      [x.dtype], grid=(gx, T, B), threadgroup=(min(gx, 64), 1, 1),
                      template=[("T", x.dtype), ("TRADITIONAL", bool(traditional)), ("FORWARD", bool(forward))],
                      emulator_options=options)
    return y.reshape(x.shape)


@lru_cache(maxsize=None)
def _function(backend: str, dims: int, traditional: bool, scale: float, options: tuple):
    @mx.custom_function
    def fn(x, inv_freq, offset):
        return _rotate(x, inv_freq, offset, dims, traditional, scale, True, backend, options)

    @fn.vjp
    def fn_vjp(primals, cotangent, output):
        x, inv_freq, offset = primals
        dx = _rotate(cotangent.astype(x.dtype), inv_freq, offset, dims, traditional, scale, False, backend, options)
        return dx, mx.zeros_like(inv_freq), mx.zeros_like(offset)

    return fn


def rope(x, dims: int, traditional: bool, base: float, scale: float, offset, freqs, backend: str,
         emulator_options=()):
    """Rotary embedding of ``x [..., T, D]`` on the kernel (same semantics as ``mx.fast.rope``).

    Check `supports` first. ``offset`` is an int or a 0-d int array. Differentiable in ``x``.
    """
    inv_freq = rope_frequencies(dims, base, freqs)
    offset = mx.array(offset).astype(mx.int32).reshape(())
    fn = _function(backend, int(dims), bool(traditional), float(scale), launch.options_key(emulator_options))
    return fn(x, inv_freq, offset)

"""Products with MLX affine-quantized matrices, fast on the CPU: `quantized_matmul`, `dequantize`.

The matrix is stored as ``mx.quantize`` stores it in ``"affine"`` mode: ``w`` (uint32
``[N, K * bits / 32]``, each row a little-endian bit stream of ``K`` values), ``scales`` and
``biases`` (``[N, K / group_size]``); it stands for ``W = scales * q + biases``
(``mx.dequantize(w, scales, biases)``).

On CPU streams both functions run as native MLX primitives from metalnn's extension
(``metalnn.cpu._fastmath``, built from ``metalnn/cpu/native/fastmath/qmatmul.cpp``): AVX2+FMA kernels
chosen at run time (a portable C++ path elsewhere) that decode the packed values in registers
and multiply in float32, multi-threaded over the rows of ``W`` (``METALNN_NUM_THREADS`` /
`metalnn.cpu.im2col.set_num_threads` cap the threads). MLX's own CPU ``quantized_matmul`` unpacks
value by value; for one input row this is several times faster (``python scripts/bench_generate.py``
prints the table). For many input rows, ``x @ dequantize(...).T`` (BLAS) is faster than either.

Bits 1-6 and 8, group sizes 32, 64 and 128; ``x`` float32, float16 or bfloat16 of any layout;
scales and biases in any of those dtypes. They work under ``mx.grad`` / ``mx.vjp`` (the input
gradient of ``x @ W.T`` is ``g @ W``, the other primitive direction; gradients for scales and
biases come from MLX's ops; the packed weight has none, as in MLX), ``mx.jvp``, ``mx.vmap``
over ``x`` and ``mx.compile``.

Without the extension (macOS, a failed build, another mlx: see `unavailable_reason`), on a GPU
stream, or for other modes, shapes or dtypes, both fall back to ``mx.quantized_matmul`` /
``mx.dequantize`` with the same meaning.
"""

from __future__ import annotations

import mlx.core as mx

from . import native_ext as _native_ext
from .device import on_cpu

__all__ = ["quantized_matmul", "dequantize", "available", "unavailable_reason", "supports"]

# The loaded extension or None; read at every call (tests swap in None for the fallback).
_ext = _native_ext.extension()

_FLOATS = (mx.float32, mx.float16, mx.bfloat16)
_UINT32 = mx.uint32
_CPU = mx.DeviceType.cpu
_GROUPS = (32, 64, 128)
_BITS = (1, 2, 3, 4, 5, 6, 8)


def available() -> bool:
    """True when the native primitives are loaded (CPU streams use them)."""
    return _ext is not None


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (``None`` when it is True)."""
    return None if _ext is not None else (_native_ext.unavailable_reason() or "replaced by the MLX ops")


def _on_cpu(stream) -> bool:
    if stream is None:
        return on_cpu()
    device = stream.device if isinstance(stream, mx.Stream) else stream
    kind = device if isinstance(device, mx.DeviceType) else device.type
    return kind == _CPU


def supports(w, scales, biases, group_size: int, bits: int, mode: str = "affine", x=None, stream=None) -> bool:
    """Whether the native primitives serve this call (else the MLX ops do)."""
    return (_ext is not None and mode == "affine" and biases is not None and bits in _BITS
            and group_size in _GROUPS and w.dtype == _UINT32 and w.ndim == 2 and scales.ndim == 2
            and scales.dtype in _FLOATS and biases.dtype in _FLOATS and (x is None or x.dtype in _FLOATS)
            and _on_cpu(stream))


def quantized_matmul(x, w, scales, biases=None, *, transpose: bool = True, group_size: int = 64, bits: int = 4,
                     mode: str = "affine", stream=None):
    """``x @ W.T`` (``transpose=True``) or ``x @ W`` with ``W = mx.dequantize(w, scales, biases)``.

    Same arguments and result (shape and dtype: ``x``'s and the scales' promoted) as
    ``mx.quantized_matmul``. ``x`` is ``[..., K]`` (``[..., N]`` when ``transpose=False``).
    """
    if supports(w, scales, biases, group_size, bits, mode, x, stream):
        return _ext.quantized_matmul(x, w, scales, biases, transpose=transpose, group_size=group_size, bits=bits,
                                     stream=stream)
    return mx.quantized_matmul(x, w, scales, biases, transpose=transpose, group_size=group_size, bits=bits,
                               mode=mode, stream=stream)


def dequantize(w, scales, biases=None, *, group_size: int = 64, bits: int = 4, mode: str = "affine", dtype=None,
               stream=None):
    """``W = scales * q + biases`` ``[N, K]``, like ``mx.dequantize`` (in ``dtype``, default the scales')."""
    if supports(w, scales, biases, group_size, bits, mode, None, stream):
        out = _ext.dequantize(w, scales, biases, group_size=group_size, bits=bits, stream=stream)
        dtype = scales.dtype if dtype is None else dtype
        return out if dtype == mx.float32 else out.astype(dtype, stream=stream)
    return mx.dequantize(w, scales, biases, group_size, bits, mode=mode, dtype=dtype, stream=stream)

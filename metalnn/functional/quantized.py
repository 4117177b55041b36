"""Quantized products in MLX's packed formats (``mx.quantize``): which implementation runs.

``weight`` holds values packed into ``uint32`` words (``[out, in * bits / 32]``), ``scales`` (and, in
``"affine"`` mode, ``biases``) one float per group of ``group_size`` inputs (``[out, in / group_size]``).

* ``"reference"`` devices: MLX's ops (``mx.quantized_matmul``; on the CPU, for many rows,
  ``mx.dequantize`` and a float product).
* every other choice: on the CPU, metalnn's native kernels (`metalnn.cpu.qmatmul`, affine mode, when
  the extension is loaded, else the same MLX ops): the quantized product for few rows, a native
  dequantize and a float (BLAS) product for many rows. Elsewhere MLX's ``mx.quantized_matmul``.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from ..cpu import qmatmul
from ..device import resolve
from ._dispatch import on_cpu

#: rows from which a product on the CPU dequantizes the weight once and multiplies in float (BLAS):
#: MLX's CPU ``quantized_matmul`` unpacks the whole weight again for every row, so a prompt of T
#: tokens would cost T unpackings (measured: one unpacking costs about as much as 4 rows)
CPU_DEQUANTIZE_ROWS = 6

#: with metalnn's native kernels (`metalnn.cpu.qmatmul`, the ``"auto"`` kernels on the CPU), fewer rows
#: than this run the native quantized product; more rows dequantize natively and multiply in float.
#: ``python scripts/bench_generate.py --rows`` measured the crossover at 8-16 rows for SmolLM2's
#: shapes (2-core x86_64, shared machine)
CPU_NATIVE_ROWS = 12


def quantize_weight(w, group_size, bits, mode):
    """``(weight, scales, biases or None)`` of a float matrix."""
    out = mx.quantize(w, group_size, bits, mode=mode)
    return out[0], out[1], (out[2] if len(out) > 2 else None)


def dequantize_weight(w, scales, biases, group_size, bits, mode, dtype=None):
    """The float matrix ``[out, in]`` of packed parameters (computed in ``dtype``, default the
    scales'; float32 gives ``scales * q + biases`` exactly)."""
    if dtype is not None and mx.issubdtype(scales.dtype, mx.floating) and scales.dtype != dtype:
        scales = scales.astype(dtype)  # mx.dequantize computes in the scales' dtype
        biases = None if biases is None else biases.astype(dtype)
    return mx.dequantize(w, scales, biases, group_size, bits, mode=mode, dtype=dtype)


def _dequantize_native(w, scales, biases, group_size, bits, mode, dtype):
    """`dequantize_weight` on `metalnn.cpu.qmatmul` (native on the CPU in affine mode, else MLX's op)."""
    return qmatmul.dequantize(w, scales, biases, group_size=group_size, bits=bits, mode=mode, dtype=dtype)


@functools.lru_cache(maxsize=None)
def _dequantized_product(group_size, bits, mode, has_biases, dtype, native):
    """``f(x, weight, scales[, biases]) = x @ dequantize(weight, dtype).T`` whose backward dequantizes
    the weight again instead of keeping the forward's float copy: training through quantized layers
    then holds only their packed weights between the passes, not a float model's worth
    (``mx.depends`` on the cotangent keeps ``mx.compile`` from merging the two dequantizations).
    Gradients: the input's, and the scales' / biases' (computed only when asked for). ``native``:
    dequantize with `metalnn.cpu.qmatmul` rather than ``mx.dequantize``."""
    dequantize_fn = _dequantize_native if native else dequantize_weight

    def weight(packed):
        return dequantize_fn(packed[0], packed[1], packed[2] if has_biases else None, group_size, bits, mode, dtype)

    @mx.custom_function
    def product(x, *packed):
        return x @ weight(packed).T

    @product.vjp
    def product_vjp(primals, cotangent, output):
        x, *packed = primals
        later = mx.depends(list(packed), [cotangent])
        dx = (cotangent @ weight(later)).astype(x.dtype)
        dw = cotangent.reshape(-1, cotangent.shape[-1]).T @ x.reshape(-1, x.shape[-1])
        _, (d_scales, *d_biases) = mx.vjp(lambda *sb: [weight((later[0], *sb))], list(later[1:]),
                                          [dw.astype(dtype)])
        return (dx, mx.zeros_like(packed[0]), d_scales, *d_biases)

    return product


def quantized_matmul(x, weight, scales, biases=None, *, group_size: int, bits: int, mode: str = "affine",
                     device=None, recompute: bool = True):
    """``x @ W.T`` for ``x`` ``[..., in]`` and the packed ``W`` ``[out, in]``: ``[..., out]``.

    ``recompute``: when the weight is dequantized (many rows on the CPU), the backward pass
    dequantizes it again (`_dequantized_product`) rather than keeping the forward's float copy.
    Gradients flow to ``x`` (and to the scales / biases when asked for).
    """
    rows = x.size // max(x.shape[-1], 1)
    b = biases
    reference = resolve(device).kernels == "reference"
    if not on_cpu() or rows < (CPU_DEQUANTIZE_ROWS if reference else CPU_NATIVE_ROWS):
        if reference:
            return mx.quantized_matmul(x, weight, scales, b, transpose=True, group_size=group_size, bits=bits,
                                       mode=mode)
        return qmatmul.quantized_matmul(x, weight, scales, b, group_size=group_size, bits=bits, mode=mode)
    dtype = x.dtype if x.dtype == scales.dtype else mx.float32  # the product's promoted dtype
    if not mx.issubdtype(scales.dtype, mx.floating):  # the e8m0 / e4m3 scales of the mx/nv modes
        dtype = x.dtype
    if not recompute:
        dequantize_fn = dequantize_weight if reference else _dequantize_native
        return x @ dequantize_fn(weight, scales, b, group_size, bits, mode, dtype).T
    product = _dequantized_product(group_size, bits, mode, b is not None, dtype, not reference)
    return product(x, weight, scales, *([] if b is None else [b]))

"""Products with GGML-packed weights on custom kernels (``metal_kernels/ggml.metal``), every type of
`metalnn.ggml`.

Three kernels, each instantiated per type (template ``Q``: the GGUF type id):

* ``dequantize``: packed rows ``uint8 [rows, row_bytes]`` -> ``float32 [rows, cols]``, bit-exact with
  the type's MLX decoder (`metalnn.ggml.GGMLType.decode`);
* ``matvec``: ``x @ W.T`` for few rows of ``x`` (decoding: up to `MATVEC_MAX_ROWS`), a SIMD group per
  two rows of ``W``, simd sums;
* ``matmul``: the same product tiled (32 x 32 output tiles, the weight decoded chunk by chunk into
  threadgroup memory, ``simdgroup_float8x8`` products) for prompts.

`ggml_matmul` is an ``mx.custom_function`` (built once per type, backend, emulator options and kernel
choice): its VJP gives ``x`` the gradient ``g @ W`` (``dequantize`` then an MLX matmul in float32,
decoded after the cotangent exists, so only the packed weight is kept between the passes, and in
slices of at most `BACKWARD_SLICE_VALUES` values, so a large weight such as an output head is never
decoded whole) and the packed weight a zero gradient (it is not trainable). The codebook types
(IQ2_XXS ... IQ1_M) pass their grid, from `metalnn.ggml.grids`, to the kernels as an input.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from . import launch

FAMILY = "ggml"
DTYPES = (mx.float32, mx.float16, mx.bfloat16)

#: the types ``ggml.metal`` decodes, by name
TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
         "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4", "TQ1_0", "TQ2_0", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS",
         "IQ3_S", "IQ1_S", "IQ1_M")
#: codebook types: the name of their grid in `metalnn.ggml.grids` (passed to the kernels as ``tab``)
GRIDS = {"IQ2_XXS": "iq2xxs_grid", "IQ2_XS": "iq2xs_grid", "IQ2_S": "iq2s_grid", "IQ3_XXS": "iq3xxs_grid",
         "IQ3_S": "iq3s_grid", "IQ1_S": "iq1s_grid", "IQ1_M": "iq1s_grid"}

#: rows of x up to which `ggml_matmul` runs the matrix-vector kernel; more run the tiled one
MATVEC_MAX_ROWS = 8
MV_THREADS = 64          # 2 SIMD groups
MV_ROWS_PER_GROUP = 4    # rows of W per threadgroup (2 per SIMD group)
MM_THREADS = 128         # 4 SIMD groups
MM_TILE = 32             # rows of W and of x per threadgroup
DEQUANTIZE_THREADS = 256
KERNELS = ("matvec", "matmul")
#: the input gradient decodes the weight in row slices of at most this many values (64 MiB of float32)
BACKWARD_SLICE_VALUES = 1 << 24
#: the largest grid dimension a launch may ask for (threads, a uint32 on the GPU)
MAX_GRID = 2**31


def _unit(qtype) -> int:
    """Values one kernel thread decodes at once: 16 (a chunk of a block), or 1 for the float types."""
    return 1 if qtype.block_size == 1 else 16


def _packed(weight, qtype) -> bool:
    """A packed ``uint8 [rows, row_bytes]`` weight of a type of `TYPES`: whole blocks, not empty."""
    return (qtype.name in TYPES and weight.dtype == mx.uint8 and weight.ndim == 2 and weight.size > 0
            and weight.shape[1] % qtype.type_size == 0)


def _cols(weight, qtype) -> int:
    return weight.shape[1] // qtype.type_size * qtype.block_size


def supports_dequantize(weight, qtype) -> bool:
    """Whether ``dequantize`` takes the packed ``weight`` ``uint8 [rows, row_bytes]`` of ``qtype``: a type
    of `TYPES`, whole blocks, not empty, one thread a unit within the grid's limit."""
    return _packed(weight, qtype) and weight.shape[0] * _cols(weight, qtype) // _unit(qtype) < MAX_GRID


def supports(x, weight, qtype) -> bool:
    """Whether the products take ``x [..., cols]`` and the packed ``weight`` ``uint8 [rows, row_bytes]``
    of ``qtype``: a type of `TYPES`, x float32/float16/bfloat16 of the weight's row length, nothing empty.
    (Their input gradient decodes slices of `BACKWARD_SLICE_VALUES` values, always within the grid.)"""
    return (_packed(weight, qtype) and x.dtype in DTYPES and x.ndim >= 1 and x.size > 0
            and x.shape[-1] == _cols(weight, qtype)
            and _cdiv(weight.shape[0], MV_ROWS_PER_GROUP) * MV_THREADS < MAX_GRID)


@lru_cache(maxsize=None)
def _no_table():
    return mx.zeros((8,), dtype=mx.float32)


def table(qtype) -> mx.array:
    """The ``tab`` input of the kernels for ``qtype``: its grid (float32 ``[points, coords]``) for the
    codebook types, else 8 unused zeros."""
    name = GRIDS.get(qtype.name)
    if name is None:
        return _no_table()
    from ..ggml import grids

    return grids.as_mlx(getattr(grids, name))


def _cdiv(a, b):
    return -(-a // b)


def dequantize(weight, qtype, backend: str, emulator_options=()):
    """``float32 [rows, cols]``: the values of the packed ``weight`` ``uint8 [rows, row_bytes]``."""
    rows, cols = weight.shape[0], _cols(weight, qtype)
    threads = rows * cols // _unit(qtype)
    (out,) = launch.run(FAMILY, "dequantize", backend, [weight, table(qtype), rows, cols], [(rows, cols)],
                        [mx.float32], grid=(threads, 1, 1), threadgroup=(DEQUANTIZE_THREADS, 1, 1),
                        template=[("Q", int(qtype.type_id))], emulator_options=emulator_options)
    return out


def _product(x2, weight, qtype, kernel, backend, options):
    """``x2 [M, cols] @ W.T -> [M, rows]`` in ``x2.dtype`` by ``kernel`` (``"matvec"`` or ``"matmul"``)."""
    M, cols = x2.shape
    rows = weight.shape[0]
    if kernel == "matvec":
        grid, threadgroup = (_cdiv(rows, MV_ROWS_PER_GROUP) * MV_THREADS, 1, 1), (MV_THREADS, 1, 1)
    else:
        grid, threadgroup = (_cdiv(rows, MM_TILE) * MM_THREADS, _cdiv(M, MM_TILE), 1), (MM_THREADS, 1, 1)
    (y,) = launch.run(FAMILY, kernel, backend, [weight, x2, table(qtype), rows, cols, M], [(M, rows)], [x2.dtype],
                      grid=grid, threadgroup=threadgroup, template=[("T", x2.dtype), ("Q", int(qtype.type_id))],
                      emulator_options=options)
    return y


@lru_cache(maxsize=None)
def _function(qtype, backend: str, options: tuple, kernel):
    @mx.custom_function
    def product(x, weight):
        cols = x.shape[-1]
        x2 = x.reshape(-1, cols)
        chosen = kernel or ("matvec" if x2.shape[0] <= MATVEC_MAX_ROWS else "matmul")
        y = _product(x2, weight, qtype, chosen, backend, options)
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @product.vjp
    def product_vjp(primals, cotangent, output):
        x, weight = primals
        later = mx.depends([weight], [cotangent])[0]   # decoded after the cotangent exists
        g = cotangent.reshape(-1, weight.shape[0]).astype(mx.float32)
        cols = x.shape[-1]
        step = max(1, BACKWARD_SLICE_VALUES // cols)
        dx = None
        for r0 in range(0, weight.shape[0], step):
            w = dequantize(later[r0:r0 + step], qtype, backend, options)
            part = mx.matmul(g[:, r0:r0 + step], w)
            dx = part if dx is None else dx + part
        return dx.reshape(x.shape).astype(x.dtype), mx.zeros_like(weight)

    return product


def ggml_matmul(x, weight, qtype, backend: str, emulator_options=(), kernel=None):
    """``x @ W.T`` on the kernels: ``x [..., cols]`` (float32/float16/bfloat16) and ``W`` packed as
    ``qtype`` (``uint8 [rows, row_bytes]``) give ``[..., rows]`` in ``x.dtype`` (accumulated in float32).

    Check `supports` first. ``kernel`` forces ``"matvec"`` or ``"matmul"`` (default: ``matvec`` for at
    most `MATVEC_MAX_ROWS` rows of x). Differentiable in x; the packed weight gets a zero gradient.
    """
    if kernel is not None and kernel not in KERNELS:
        raise ValueError(f"ggml_matmul: kernel must be one of {KERNELS} or None, got {kernel!r}")
    return _function(qtype, backend, launch.options_key(emulator_options), kernel)(x, weight)

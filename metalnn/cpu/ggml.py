"""Products with weights packed in a GGML tensor type, fast on the CPU: `matmul`, `dequantize`.

A packed weight ``W`` ``[N, K]`` is ``uint8 [N, K / block_size * type_size]``: each row its blocks of
the type (`metalnn.ggml`), as a GGUF file stores it. On CPU streams both functions run as native MLX
primitives of metalnn's extension (``metalnn.cpu._fastmath``, built from
``metalnn/cpu/native/fastmath/ggml.cpp``), for every block type of `metalnn.ggml` (all but F32, F16
and BF16):

* `matmul` decodes the blocks in registers and multiplies in float32, multi-threaded over the rows
  of ``W`` (``METALNN_NUM_THREADS`` / `metalnn.cpu.im2col.set_num_threads` cap the threads). The
  legacy types, the K-quants, IQ4_NL, IQ4_XS, MXFP4 and TQ2_0 have AVX2+FMA kernels chosen at run
  time (a few input rows: 32 values at a time as int8 levels, widened to float, the sub-block scales
  applied to the partial sums; more rows: a few weight rows decoded to a float tile shared by all the
  input rows); the i-quant codebook types and TQ1_0 decode a block at a time into a buffer; elsewhere
  portable C++ runs. The result is ``x @ dequantize(W).T`` up to the order of the float32 sums (the
  common types with one or two input rows: within ~3e-6 of ``sum |w x|``, see `split_inputs`).
* `dequantize` gives the same floats as the type's MLX decoder (`metalnn.ggml.GGMLType.decode`),
  bit for bit, threaded over rows.

`matmul` works under ``mx.grad`` / ``mx.vjp`` (the input gradient ``g @ W`` is MLX's matmul with the
dequantized weight, decoded again in the backward pass; the packed weight gets a zero gradient, it is
not trainable), ``mx.jvp``, ``mx.vmap`` over ``x`` and ``mx.compile``.

For many rows of ``x`` a BLAS product with the dequantized weight is faster: `MATMUL_MAX_ROWS` is the
crossover measured by ``scripts/bench_ggml.py``.

Without the extension (macOS, a failed build, another mlx: see `unavailable_reason`), on a GPU stream,
or for the float types, both fall back to the type's MLX decoder and an MLX float32 product.
"""

from __future__ import annotations

import mlx.core as mx

from .. import ggml as _ggml
from . import native_ext as _native_ext
from .device import on_cpu

__all__ = ["matmul", "dequantize", "available", "unavailable_reason", "supports", "has_avx2", "native_types",
           "native_type_ids", "int8_input_rows", "set_int8_input_rows", "split_inputs", "set_split_inputs",
           "MATMUL_MAX_ROWS"]

# The loaded extension or None; read at every call (tests swap in None for the fallback).
_ext = _native_ext.extension()

_FLOATS = (mx.float32, mx.float16, mx.bfloat16)
_CPU = mx.DeviceType.cpu

#: Rows of ``x`` (all dims but the last, multiplied) up to which `matmul` runs; with more rows
#: ``x @ dequantize(W).T`` (MLX's BLAS product, OpenBLAS) runs instead, at the cost of decoding the
#: whole weight to a float copy on every call. Measured on whole models (a prompt of R tokens, two
#: threads, 2026-11-28): SmolLM2-135M Q4_1 takes the same time both ways at 192-256 rows, the BLAS
#: product is 1.1x faster at 384-512; on a 1B Llama (Q8_0, Q4_K_M) the native product is 2.5x faster
#: at 96 rows and 1.4x at 256, the BLAS product 1.1x faster at 512 (the float copy of 1.2 G weights
#: costs seconds). The products alone (``scripts/bench_ggml.py``, one thread each) cross at 64-96 rows:
#: inside a model the BLAS threads' spinning and the copy cost more than they do alone.
MATMUL_MAX_ROWS = 256


def available() -> bool:
    """True when the native primitives are loaded (CPU streams use them)."""
    return _ext is not None


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (``None`` when it is True)."""
    return None if _ext is not None else (_native_ext.unavailable_reason() or "replaced by the MLX ops")


def has_avx2() -> bool:
    """True when the AVX2+FMA kernels run (otherwise the portable C++ ones do)."""
    return _ext is not None and bool(_ext.ggml_has_avx2())


def int8_input_rows() -> int:
    """Input rows up to which products take their input quantized to int8 (0: never; the default).

    With int8 inputs (llama.cpp's method: every 32 input values, 256 for Q4_K, Q5_K and Q6_K, become
    int8 levels and a scale max|x| / 127, and the products are integer dot products) decoding
    products run 1.25-1.5x faster single-threaded (``scripts/bench_products_llamacpp.py``) but are
    less exact: on the bundled SmolLM2-135M Q4_1 the greedy continuation of "The capital of France
    is" stays " Paris." and then goes another way. ``METALNN_GGML_INT8_ROWS=8`` in the environment
    sets it at start-up; `metalnn.functional.ggml_int8_inputs` (the commands' ``--int8-products``)
    switches it for a block.
    """
    return int(_ext.ggml_get_int8_rows()) if _ext is not None else 0


def set_int8_input_rows(rows: int) -> None:
    """Set `int8_input_rows` (e.g. 8: decoding steps of up to 8 sequences; 0: float32 inputs)."""
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
        raise ValueError(f"set_int8_input_rows: rows must be an int >= 0, got {rows!r}")
    if _ext is not None:
        _ext.ggml_set_int8_rows(rows)


def split_inputs() -> bool:
    """Whether products of one or two input rows with Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and
    Q6_K weights take the input as two int8 levels (True: the default).

    Every 32 input values (256 for the K-quants, as llama.cpp's Q8_0 / Q8_K inputs) become 16-bit
    levels ``X = round(x * 127 * 254 / max|x|)`` held as two int8 levels ``X = 254 a + b``, so each
    value is within ``max|x| / 64516`` of the float32 input (one int8 level: ``max|x| / 254``) and a
    product within ~3e-6 of ``sum |w x|`` (one int8 level: ~4e-3; float32 inputs: ~2e-8). The products
    are integer dot products with both levels: 1.05-1.5x faster than with float32 inputs on one
    decoding row (``scripts/bench_products_llamacpp.py``); ``scripts/product_inputs_quality.py``
    shows what it does to a model's logits and perplexity. ``METALNN_GGML_SPLIT_INPUTS=0`` in the environment
    switches it off at start-up; `metalnn.functional.ggml_exact_inputs` (the commands'
    ``--exact-products``) for a block. `int8_input_rows`, where it applies, takes precedence.
    """
    return bool(_ext.ggml_get_split_inputs()) if _ext is not None else False


def set_split_inputs(enabled: bool) -> None:
    """Set `split_inputs` (False: every product takes its input in float32, unless int8)."""
    if not isinstance(enabled, bool):
        raise ValueError(f"set_split_inputs: enabled must be a bool, got {enabled!r}")
    if _ext is not None:
        _ext.ggml_set_split_inputs(enabled)


def _type(type_name):
    """The `metalnn.ggml` class of a type name (``"Q4_K"``), GGUF type id or class."""
    if isinstance(type_name, type) and issubclass(type_name, _ggml.GGMLType):
        return type_name
    return _ggml.get_type(type_name)


def native_types() -> tuple:
    """Names of the types the native primitives run (empty without the extension)."""
    if _ext is None:
        return ()
    ids = set(_ext.ggml_type_ids())
    return tuple(name for name, cls in _ggml.TYPES.items() if cls.type_id in ids)


_TYPE_IDS: dict = {}


def native_type_ids() -> frozenset:
    """GGUF type ids of the types the native primitives run (empty without the extension)."""
    if _ext is None:
        return frozenset()
    ids = _TYPE_IDS.get(id(_ext))
    if ids is None:
        ids = _TYPE_IDS[id(_ext)] = frozenset(_ext.ggml_type_ids())
    return ids


def _on_cpu(stream) -> bool:
    if stream is None:
        return on_cpu()
    device = stream.device if isinstance(stream, mx.Stream) else stream
    kind = device if isinstance(device, mx.DeviceType) else device.type
    return kind == _CPU


def supports(weight, type_name, x=None, stream=None) -> bool:
    """Whether the native primitives serve this call (else the MLX decoder does): the extension is
    loaded, the type is a block type, ``weight`` is ``uint8 [N, whole blocks]``, ``x`` (if given) is
    float32, float16 or bfloat16 ``[..., K]``, and the stream is a CPU one."""
    if _ext is None:
        return False
    cls = _type(type_name)
    if cls.block_size == 1 or weight.dtype != mx.uint8 or weight.ndim != 2 or weight.shape[1] % cls.type_size:
        return False
    if x is not None:
        k = weight.shape[1] // cls.type_size * cls.block_size
        if x.dtype not in _FLOATS or x.ndim < 1 or x.shape[-1] != k:
            return False
    return _on_cpu(stream)


def matmul(x, weight, type_name, *, stream=None):
    """``x @ W.T``: ``x`` ``[..., K]`` and ``W`` packed as ``type_name`` (``uint8 [N, row_bytes]``) give
    ``[..., N]`` in ``x``'s dtype (float32 math). Gradients flow to ``x``."""
    cls = _type(type_name)
    if supports(weight, cls, x, stream):
        y = _ext.ggml_matmul(x, weight, cls.type_id, stream=stream)
    else:
        w = cls.decode(weight)
        y = mx.matmul(x.astype(mx.float32, stream=stream), w.T, stream=stream)
    return y if x.dtype == mx.float32 else y.astype(x.dtype, stream=stream)


def dequantize(weight, type_name, dtype=mx.float32, *, stream=None):
    """The float matrix ``[N, K]`` of a packed weight ``uint8 [N, row_bytes]`` (in ``dtype``), equal to
    the type's MLX decoder."""
    cls = _type(type_name)
    if supports(weight, cls, None, stream):
        w = _ext.ggml_dequantize(weight, cls.type_id, stream=stream)
    else:
        w = cls.decode(weight)
    return w if dtype == mx.float32 else w.astype(dtype, stream=stream)

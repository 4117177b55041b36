"""Products with weights packed in a GGML tensor type (`metalnn.ggml`): which implementation runs.

A packed weight ``W`` ``[out, in]`` is ``uint8 [out, in / block_size * type_size]``: each row its blocks.
``"metal"`` / ``"emulate"`` run the kernels of `metalnn.kernels.ggml` (``metal_kernels/ggml.metal``: every
type of `metalnn.ggml`, x float32/float16/bfloat16) through ``mx.fast.metal_kernel`` or the CPU emulator:
a matrix-vector kernel for a few rows of x (decoding), a tiled one for more (prompts), and ``dequantize``
in the backward pass. ``"auto"`` on the CPU backend runs metalnn's native kernels (`metalnn.cpu.ggml`:
blocks decoded in registers, AVX2 for the common types, threaded): their product for up to
`metalnn.cpu.ggml.MATMUL_MAX_ROWS` rows of x, their dequantize and a BLAS product for more.
``"reference"`` and the calls no kernel takes decode the weight with the type's MLX decoder
(`metalnn.ggml.GGMLType.decode`) and multiply in float32. Either way the
backward pass decodes the weight again rather than keeping a float copy from the forward pass, so
training adapters over a packed model holds only the packed weights between the passes.
"""

from __future__ import annotations

import contextlib
import functools

import mlx.core as mx

from ..cpu import ggml as cpu_ggml
from ..device import resolve
from ..kernels import ggml as kernels
from ._dispatch import emulator_options, kernel_backend, on_cpu


def ggml_dequantize(weight, qtype, dtype=mx.float32, *, device=None):
    """The float matrix ``[out, in]`` of a packed weight ``uint8 [out, row_bytes]`` (in ``dtype``).

    Args:
        device: when given and on ``"metal"`` / ``"emulate"`` kernels, the ``dequantize`` kernel decodes
            (bit-exact with the type's MLX decoder, which runs otherwise).
    """
    device = resolve(device) if device is not None else None
    backend = kernel_backend(device) if device is not None else None
    if backend and kernels.supports_dequantize(weight, qtype):
        w = kernels.dequantize(weight, qtype, backend, emulator_options(device))
    elif (device is None or device.kernels != "reference") and on_cpu() and cpu_ggml.supports(weight, qtype):
        w = cpu_ggml.dequantize(weight, qtype)
    else:
        w = qtype.decode(weight)
    return w if dtype == mx.float32 else w.astype(dtype)


@functools.lru_cache(maxsize=None)
def _decoded_product(qtype, dtype, native):
    """``f(x, weight) = x @ decode(weight).T`` whose backward decodes the weight again (the packed
    weight gets a zero gradient: it is not trainable). ``native``: decode with `metalnn.cpu.ggml`
    instead of the MLX decoder (bit-identical)."""
    decode = functools.partial(cpu_ggml.dequantize, type_name=qtype) if native else qtype.decode

    def weight_of(packed):
        w = decode(packed)
        return w if dtype == mx.float32 else w.astype(dtype)

    @mx.custom_function
    def product(x, weight):
        return x @ weight_of(weight).T

    @product.vjp
    def product_vjp(primals, cotangent, output):
        x, weight = primals
        later = mx.depends([weight], [cotangent])[0]   # decoded after the cotangent exists
        dx = (cotangent @ weight_of(later)).astype(x.dtype)
        return dx, mx.zeros_like(weight)

    return product


def ggml_matmul(x, weight, qtype, *, device=None):
    """``x @ W.T``: ``x`` ``[..., in]`` and ``W`` packed as ``qtype`` (``uint8 [out, row_bytes]``) give
    ``[..., out]`` in ``x``'s dtype. Gradients flow to ``x``.

    Implementation by ``device.kernels``: ``"metal"`` / ``"emulate"`` the kernels of
    `metalnn.kernels.ggml` for the calls its ``supports`` accepts (x float32/float16/bfloat16, not
    empty; accumulated in float32; the input gradient ``g @ W`` from the ``dequantize`` kernel and an
    MLX matmul in float32); otherwise the type's MLX decoder and an MLX matmul (float32 for float32
    inputs; half inputs multiply a half copy of the weight).
    """
    in_features = weight.shape[-1] // qtype.type_size * qtype.block_size
    if x.shape[-1] != in_features:
        raise ValueError(f"ggml_matmul: x has {x.shape[-1]} features, the {qtype.name} weight "
                         f"{tuple(weight.shape)} holds rows of {in_features}")
    device = resolve(device)
    backend = kernel_backend(device)
    if backend and kernels.supports(x, weight, qtype):
        return kernels.ggml_matmul(x, weight, qtype, backend, emulator_options(device))
    dtype = x.dtype if x.dtype in (mx.float16, mx.bfloat16) else mx.float32
    native = device.kernels != "reference" and on_cpu() and cpu_ggml.supports(weight, qtype, x)
    rows = x.size // max(x.shape[-1], 1)
    if native and rows <= cpu_ggml.MATMUL_MAX_ROWS:
        return cpu_ggml.matmul(x, weight, qtype)
    return _decoded_product(qtype, dtype, native)(x, weight)


#: Input rows up to which `ggml_int8_inputs` quantizes the inputs: decoding steps of up to 8
#: sequences (the int8 register kernels beat the float decoded-rows product there: 1.1-1.4x at 5-8
#: rows of a SmolLM2-shaped Q4_1 / Q8_0 weight); more rows run the decoded-rows product in float32.
INT8_INPUT_ROWS = 8


@contextlib.contextmanager
def ggml_int8_inputs(enabled: bool = True):
    """Within the block, products with GGML weights on the CPU take their input quantized to int8 as
    llama.cpp computes them (every 32 input values, 256 for Q4_K, Q5_K and Q6_K, become int8 levels
    and a scale max|x| / 127; integer dot products per block) when they have at most
    `INT8_INPUT_ROWS` input rows, which is what decoding runs: 1.1-1.3x faster decoding of GGUF
    models, a little less exact (the default inputs give ``x @ dequantize(W).T`` up to the order of
    the sums, or within ~3e-6 of ``sum |w x|``: `ggml_exact_inputs`). The setting is
    process-wide (`metalnn.cpu.ggml.set_int8_input_rows`) and restored on exit; ``enabled=False``
    leaves it as it is. No effect off the CPU or without the native extension."""
    with _process_setting(cpu_ggml.int8_input_rows, cpu_ggml.set_int8_input_rows, INT8_INPUT_ROWS, enabled):
        yield


@contextlib.contextmanager
def ggml_exact_inputs(enabled: bool = True):
    """Within the block, products with GGML weights on the CPU take their input in float32 (the
    products of the dequantized weights up to the order of the float32 sums), also the decoding
    products of the common types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), which otherwise take
    it as two int8 levels (`metalnn.cpu.ggml.split_inputs`: within ~3e-6 of ``sum |w x|``, 1.05-1.5x
    faster). The setting is process-wide and restored on exit;
    ``enabled=False`` leaves it as it is. No effect off the CPU or without the native extension."""
    with _process_setting(cpu_ggml.split_inputs, cpu_ggml.set_split_inputs, False, enabled):
        yield


@contextlib.contextmanager
def _process_setting(get, put, value, enabled: bool):
    """A process-wide setting at ``value`` within the block (untouched if not ``enabled``), then
    restored, also after an error."""
    if not enabled:
        yield
        return
    old = get()
    put(value)
    try:
        yield
    finally:
        put(old)

"""Products with weights packed in a GGML tensor type (`metalnn.ggml`): which implementation runs.

A packed weight ``W`` ``[out, in]`` is ``uint8 [out, in / block_size * type_size]``: each row its blocks.
``"reference"`` and, for now, every other kernel choice decode the weight with the type's MLX decoder
(`metalnn.ggml.GGMLType.decode`) and multiply in float32; the backward pass decodes it again rather than
keeping the float copy from the forward pass, so training adapters over a packed model holds only the
packed weights between the passes.
"""

from __future__ import annotations

import functools

import mlx.core as mx


def ggml_dequantize(weight, qtype, dtype=mx.float32):
    """The float matrix ``[out, in]`` of a packed weight ``uint8 [out, row_bytes]`` (in ``dtype``)."""
    w = qtype.decode(weight)
    return w if dtype == mx.float32 else w.astype(dtype)


@functools.lru_cache(maxsize=None)
def _decoded_product(qtype, dtype):
    """``f(x, weight) = x @ decode(weight).T`` whose backward decodes the weight again (the packed
    weight gets a zero gradient: it is not trainable)."""

    @mx.custom_function
    def product(x, weight):
        return x @ ggml_dequantize(weight, qtype, dtype).T

    @product.vjp
    def product_vjp(primals, cotangent, output):
        x, weight = primals
        later = mx.depends([weight], [cotangent])[0]   # decoded after the cotangent exists
        dx = (cotangent @ ggml_dequantize(later, qtype, dtype)).astype(x.dtype)
        return dx, mx.zeros_like(weight)

    return product


def ggml_matmul(x, weight, qtype, *, device=None):
    """``x @ W.T``: ``x`` ``[..., in]`` and ``W`` packed as ``qtype`` (``uint8 [out, row_bytes]``) give
    ``[..., out]`` in ``x``'s dtype (float32 for float32 inputs; half inputs multiply a half copy of
    the weight). Gradients flow to ``x``.

    Args:
        device: the `Device` whose kernel choice applies (every choice runs the decoder today).
    """
    in_features = weight.shape[-1] // qtype.type_size * qtype.block_size
    if x.shape[-1] != in_features:
        raise ValueError(f"ggml_matmul: x has {x.shape[-1]} features, the {qtype.name} weight "
                         f"{tuple(weight.shape)} holds rows of {in_features}")
    dtype = x.dtype if x.dtype in (mx.float16, mx.bfloat16) else mx.float32
    return _decoded_product(qtype, dtype)(x, weight)

"""Layers whose weights stay packed in a GGML tensor type (`metalnn.ggml`): `GGMLLinear`, `GGMLEmbedding`.

The weight is held as the file holds it, ``uint8 [rows, row_bytes]`` (each row its blocks of the type),
so a model read from a GGUF file of any type takes about the file's size. Products run on
`metalnn.functional.ggml_matmul`; lookups decode only the rows they use. The packed weights are frozen;
gradients flow to the inputs (adapters can be trained on top).
"""

from __future__ import annotations

import mlx.core as mx

from .. import functional as F
from .. import ggml
from ..data import Data, MTLSize
from .base import Layer
from .embedding import TokenLookup


def _positive(layer, name, v):
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{layer}: {name} must be a positive int, got {v!r}")
    return int(v)


class _Packed(Layer):
    """What the GGML layers share: the type, the packed weight and its float view."""

    def _set_type(self, where, qtype, width):
        self.qtype = ggml.get_type(qtype) if not isinstance(qtype, type) else qtype
        self.qtype.row_bytes(width)   # raises unless the width is whole blocks
        self.ggml_type = self.qtype.name

    def _check_packed(self, weight, rows, width):
        want = (rows, self.qtype.row_bytes(width))
        if weight.dtype != mx.uint8 or tuple(weight.shape) != want:
            raise ValueError(f"{self._describe()}: a {self.ggml_type} weight of {rows} x {width} values is uint8 "
                             f"{want}, got {str(weight.dtype).rpartition('.')[2]} {tuple(weight.shape)}")

    def dequantized_weight(self, dtype=mx.float32) -> mx.array:
        """The float weight ``[rows, width]`` the packed blocks stand for."""
        return F.ggml_dequantize(self.weight, self.qtype, dtype)

    @property
    def dtype(self):
        return mx.float32


class GGMLLinear(_Packed):
    """``y = x @ W.T (+ bias)`` with ``W`` ``[out_features, in_features]`` packed in a GGML type.

    Input dims ``(W=in_features, H, D)`` -> ``(W=out_features, H, D)``; a plain array
    ``[..., in_features]`` gives ``[..., out_features]``. Parameters: ``weight`` (``uint8
    [out_features, in_features / block_size * type_size]``) and the float ``bias`` ``[out_features]``.

    Args:
        out_features, in_features: the weight's shape; ``in_features`` must be whole blocks of the type.
        ggml_type: the type's name (``"Q4_K"``) or class.
        bias: add a float bias.

    A fresh layer holds all-zero blocks; `from_packed` wraps the bytes of a checkpoint.
    """

    fixed_axes = ("W",)
    positional_hint = "{cls}({out_features}, in_features=..., ggml_type=...)"

    def __init__(self, out_features: int, *, in_features: int, ggml_type, bias: bool = False):
        super().__init__()
        self.out_features = _positive("GGMLLinear", "out_features", out_features)
        in_features = _positive("GGMLLinear", "in_features", in_features)
        self._set_type("GGMLLinear", ggml_type, in_features)
        self.weight = mx.zeros((self.out_features, self.qtype.row_bytes(in_features)), dtype=mx.uint8)
        self.use_bias = bool(bias)
        if self.use_bias:
            self.bias = mx.zeros((self.out_features,))
        self.in_features = in_features
        self.mark_built(MTLSize(in_features))
        self.freeze()

    @classmethod
    def from_packed(cls, weight, ggml_type, in_features: int, bias=None) -> "GGMLLinear":
        """A layer holding the packed bytes ``weight`` ``uint8 [out, row_bytes]`` of a ``ggml_type`` matrix
        with rows of ``in_features`` values (and a float ``bias``, or None)."""
        layer = cls(int(weight.shape[0]), in_features=in_features, ggml_type=ggml_type, bias=bias is not None)
        layer._check_packed(weight, layer.out_features, in_features)
        layer.weight = weight
        if bias is not None:
            layer.bias = bias
        layer.freeze()
        return layer

    def forward(self, device, data):
        y = F.ggml_matmul(data.array, self.weight, self.qtype, device=device)
        if self.use_bias:
            y = y + self.bias
        d = data.dims
        return Data(y, MTLSize(self.out_features, d.H, d.D))

    def _extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"ggml_type={self.ggml_type}, bias={self.use_bias}")


class GGMLEmbedding(TokenLookup, _Packed):
    """`Embedding` with the ``[num_embeddings, dims]`` table packed in a GGML type.

    Looking up ids decodes only the rows used; `as_linear` multiplies by the table as an output
    projection (tied embeddings). Layouts as `Embedding`: ids ``[B, T]`` give ``[B, T, dims]``.

    Args:
        num_embeddings, dims: the table's shape; ``dims`` must be whole blocks of the type.
        ggml_type: the type's name or class.
    """

    positional_hint = "{cls}({num_embeddings}, {dims}, ggml_type=...)"

    def __init__(self, num_embeddings: int, dims: int, *, ggml_type):
        super().__init__()
        self.num_embeddings = _positive("GGMLEmbedding", "num_embeddings", num_embeddings)
        self.dims = _positive("GGMLEmbedding", "dims", dims)
        self._set_type("GGMLEmbedding", ggml_type, self.dims)
        self.weight = mx.zeros((self.num_embeddings, self.qtype.row_bytes(self.dims)), dtype=mx.uint8)
        self._built = True
        self.freeze()

    @classmethod
    def from_packed(cls, weight, ggml_type, dims: int) -> "GGMLEmbedding":
        """A table holding the packed bytes ``weight`` ``uint8 [num_embeddings, row_bytes]``."""
        layer = cls(int(weight.shape[0]), dims, ggml_type=ggml_type)
        layer._check_packed(weight, layer.num_embeddings, dims)
        layer.weight = weight
        layer.freeze()
        return layer

    def lookup(self, ids):
        return self.qtype.decode(self.weight[ids])

    def as_linear(self, x, *, device=None):
        """``x @ table.T`` ``[..., dims] -> [..., num_embeddings]`` (tied output projection)."""
        return F.ggml_matmul(x, self.weight, self.qtype, device=device)

    def _extra_repr(self):
        return f"{self.num_embeddings}, {self.dims}, ggml_type={self.ggml_type}"

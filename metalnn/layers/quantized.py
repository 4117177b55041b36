"""Quantized layers: `QuantizedLinear` and `QuantizedEmbedding` (MLX's packed formats).

A quantized weight is stored as MLX stores it (``mx.quantize``): ``weight`` holds the values packed
into ``uint32`` words (``[out, in * bits / 32]``), ``scales`` (and, in ``"affine"`` mode, ``biases``)
hold one float per group of ``group_size`` consecutive inputs (``[out, in / group_size]``). The
affine value of an element is ``scales * q + biases``. The products run on
`metalnn.functional.quantized_matmul` (``mx.quantized_matmul``, or on the CPU metalnn's native kernels) and lookups on ``mx.dequantize``; the
parameters are frozen (gradients still flow to the input, so adapters can be trained on top of a
quantized model).

Parameter names are the float layers' plus ``scales`` / ``biases``, so MLX-quantized checkpoints
(``q_proj.weight``, ``q_proj.scales``, ``q_proj.biases``) load by name.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx

from .. import init as initializers
from ..data import Data, MTLSize
from .. import functional as F
from .embedding import TokenLookup
from .base import Layer
from .linear import float_dtype

#: mode -> (allowed group sizes, allowed bits, default group size, default bits), as mx.quantize documents
MODES = {
    "affine": ((32, 64, 128), (1, 2, 3, 4, 5, 6, 8), 64, 4),
    "mxfp4": ((32,), (4,), 32, 4),
    "mxfp8": ((32,), (8,), 32, 8),
    "nvfp4": ((16,), (4,), 16, 4),
}


def quant_settings(group_size=None, bits=None, mode="affine", where="quantize"):
    """Validated ``(group_size, bits, mode)``; None takes the mode's default. Raises ValueError
    naming ``where`` and the allowed values."""
    if mode not in MODES:
        raise ValueError(f"{where}: unknown quantization mode {mode!r}; use one of {sorted(MODES)}")
    groups, allowed_bits, g0, b0 = MODES[mode]
    group_size = g0 if group_size is None else group_size
    bits = b0 if bits is None else bits
    if group_size not in groups:
        raise ValueError(f"{where}: group_size {group_size!r} is not supported in {mode!r} mode (use one of "
                         f"{list(groups)})")
    if bits not in allowed_bits:
        raise ValueError(f"{where}: bits {bits!r} is not supported in {mode!r} mode (use one of {list(allowed_bits)})")
    return int(group_size), int(bits), mode


class _Quantized(Layer):
    """What the quantized layers share: settings, packed sizes and freezing."""

    def _settings(self, name, group_size, bits, mode):
        self.group_size, self.bits, self.mode = quant_settings(group_size, bits, mode, name)

    def _set_quantized(self, weight, scales, biases):
        self.weight, self.scales = weight, scales
        if biases is not None:
            self.biases = biases
        elif "biases" in self:
            del self["biases"]

    def _biases(self):
        return self.get("biases")

    @property
    def packed_width(self) -> int:
        """Logical (unpacked) width of a weight row."""
        return self.weight.shape[-1] * 32 // self.bits

    def dequantized_weight(self, dtype=None) -> mx.array:
        """The float weight ``[rows, width]`` these parameters stand for (in ``dtype``, default
        the scales'; computed in ``dtype``, so float32 gives ``scales * q + biases`` exactly)."""
        return F.dequantize_weight(self.weight, self.scales, self._biases(), self.group_size, self.bits, self.mode, dtype)

    @property
    def dtype(self):
        """The float dtype of the layer's outputs: the scales' (float32 for the e8m0 / e4m3
        scales of the mx/nv modes)."""
        return self.scales.dtype if mx.issubdtype(self.scales.dtype, mx.floating) else mx.float32

    def _check_group(self, width, what):
        if width % self.group_size:
            raise ValueError(f"{self._describe()}: {what} {width} is not a multiple of group_size {self.group_size}")

    def _qmatmul(self, x, device=None, recompute: bool = True):
        """``x @ W.T`` for ``x`` ``[..., width]`` (`metalnn.functional.quantized_matmul`)."""
        return F.quantized_matmul(x, self.weight, self.scales, self._biases(), group_size=self.group_size,
                                  bits=self.bits, mode=self.mode, device=device, recompute=recompute)


class QuantizedLinear(_Quantized):
    """``y = x @ W.T + bias`` with ``W`` stored quantized (``mx.quantized_matmul``, or on the CPU
    `metalnn.cpu.qmatmul`'s native kernels).

    Input dims ``(W=in_features, H, D)`` -> ``(W=out_features, H, D)``; a plain array
    ``[..., in_features]`` gives ``[..., out_features]``. Parameters: ``weight`` (uint32
    ``[out_features, in_features * bits / 32]``), ``scales`` and, in affine mode, ``biases``
    (``[out_features, in_features / group_size]``), and the float ``bias`` ``[out_features]``.
    All are frozen; gradients flow to the input.

    Args:
        out_features: output width. The input width comes from the first input (it must be a
            multiple of ``group_size``) or from ``in_features=``.
        bias: add a float bias.
        group_size, bits, mode: as ``mx.quantize`` (affine: groups 32/64/128, bits 1-6 or 8;
            ``"mxfp4"``, ``"mxfp8"``, ``"nvfp4"``). Default: the mode's (affine: 64 and 4).
        dtype: dtype of the scales, biases and ``bias`` (default float32, or the input's).

    A fresh layer holds a quantized random weight (`Linear`'s initialisation); use `from_linear`
    or `metalnn.quantize` to quantize trained weights, or load a checkpoint.
    """

    fixed_axes = ("W",)
    positional_hint = "{cls}({extra[0]}, in_features={out_features}, bits=...)"

    def __init__(self, out_features: int, *, in_features: int | None = None, bias: bool = True,
                 group_size: int | None = None, bits: int | None = None, mode: str = "affine", dtype=None):
        super().__init__()
        if isinstance(out_features, bool) or not isinstance(out_features, int) or out_features <= 0:
            raise ValueError(f"QuantizedLinear: out_features must be a positive int, got {out_features!r}")
        self._settings("QuantizedLinear", group_size, bits, mode)
        self.out_features = int(out_features)
        self.use_bias = bool(bias)
        self._dtype = dtype
        if in_features is not None:
            self._create(int(in_features), dtype or mx.float32, initializers.construction_key)
            self.mark_built(MTLSize(int(in_features)))

    def _create(self, in_features, dtype, next_key):
        self._check_group(in_features, "in_features")
        init = initializers.FanInUniform()
        w = init((self.out_features, in_features), in_features, self.out_features, next_key(), dtype)
        self._set_quantized(*F.quantize_weight(w, self.group_size, self.bits, self.mode))
        if self.use_bias:
            self.bias = mx.zeros((self.out_features,), dtype=dtype)
        self.freeze()

    @property
    def in_features(self) -> int:
        return self.packed_width

    def build(self, device, dims, dtype):
        self._create(dims.W, self._dtype or float_dtype(dtype), device.next_key)

    def forward(self, device, data):
        y = self._qmatmul(data.array, device)
        if self.use_bias:
            y = y + self.bias
        d = data.dims
        return Data(y, MTLSize(self.out_features, d.H, d.D))

    @classmethod
    def from_linear(cls, linear, *, group_size: int | None = None, bits: int | None = None,
                    mode: str = "affine") -> "QuantizedLinear":
        """A quantized copy of a built `Linear` (its bias stays float)."""
        if "weight" not in linear:
            raise ValueError(f"QuantizedLinear.from_linear: {linear._describe()} has no weight yet (compile it "
                             "first or give in_features=)")
        out_f, in_f = linear.weight.shape
        layer = cls(out_f, bias="bias" in linear, group_size=group_size, bits=bits, mode=mode)
        layer._check_group(in_f, f"{linear._describe()}: in_features")
        layer._set_quantized(*F.quantize_weight(linear.weight, layer.group_size, layer.bits, layer.mode))
        if "bias" in linear:
            layer.bias = linear.bias
        layer._path = linear._path
        layer.mark_built(MTLSize(in_f))
        layer.freeze()
        return layer

    def _extra_repr(self):
        return (f"in_features={self.in_features if 'weight' in self else None}, out_features={self.out_features}, "
                f"bias={self.use_bias}, group_size={self.group_size}, bits={self.bits}, mode={self.mode}")


class QuantizedEmbedding(TokenLookup, _Quantized):
    """`Embedding` with the ``[num_embeddings, dims]`` table stored quantized.

    Looking up ids dequantizes only the rows used; `as_linear` multiplies by the table as an output
    projection (as `QuantizedLinear` multiplies), for tied embeddings. Layouts as `Embedding`: ids
    ``[B, T]`` give ``[B, T, dims]``.

    Args:
        num_embeddings, dims: table size; ``dims`` must be a multiple of ``group_size``.
        group_size, bits, mode: as `QuantizedLinear`.
        dtype: dtype of the scales and biases (default float32).
    """

    positional_hint = "{cls}({num_embeddings}, {dims}, bits=...)"

    def __init__(self, num_embeddings: int, dims: int, *, group_size: int | None = None,
                 bits: int | None = None, mode: str = "affine", dtype=None):
        super().__init__()
        for name, v in (("num_embeddings", num_embeddings), ("dims", dims)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"QuantizedEmbedding: {name} must be a positive int, got {v!r}")
        self._settings("QuantizedEmbedding", group_size, bits, mode)
        self.num_embeddings, self.dims = int(num_embeddings), int(dims)
        self._check_group(self.dims, "dims")
        w = initializers.Normal(math.sqrt(1.0 / self.dims))((self.num_embeddings, self.dims), self.dims,
                                                             self.num_embeddings, initializers.construction_key(),
                                                             dtype or mx.float32)
        self._set_quantized(*F.quantize_weight(w, self.group_size, self.bits, self.mode))
        self.freeze()
        self._built = True

    def lookup(self, ids):
        b = self._biases()
        return F.dequantize_weight(self.weight[ids], self.scales[ids], None if b is None else b[ids], self.group_size,
                                   self.bits, self.mode, self.dtype)

    def as_linear(self, x, *, device=None):
        """``x @ table.T`` ``[..., dims] -> [..., num_embeddings]`` (tied output projection); ``device``
        selects the kernels as in `QuantizedLinear`.

        The float table is kept for the backward pass rather than recomputed: the logits feed
        the loss directly, so the forward's copy is still alive when the backward starts
        (recomputing it would hold two)."""
        return self._qmatmul(x, device, recompute=False)

    @classmethod
    def from_embedding(cls, embedding, *, group_size: int | None = None, bits: int | None = None,
                       mode: str = "affine") -> "QuantizedEmbedding":
        """A quantized copy of an `Embedding`."""
        group_size, bits, mode = quant_settings(group_size, bits, mode, "QuantizedEmbedding.from_embedding")
        dims = embedding.weight.shape[1]
        if dims % group_size:
            raise ValueError(f"QuantizedEmbedding.from_embedding: {embedding._describe()}: dims {dims} is not a "
                             f"multiple of group_size {group_size}")
        layer = cls.from_quantized(*F.quantize_weight(embedding.weight, group_size, bits, mode), group_size=group_size,
                                   bits=bits, mode=mode)
        layer._path = embedding._path
        return layer

    @classmethod
    def from_quantized(cls, weight, scales, biases=None, *, group_size: int, bits: int,
                       mode: str = "affine") -> "QuantizedEmbedding":
        """A layer holding already quantized arrays (as ``mx.quantize`` returns them)."""
        layer = cls.__new__(cls)
        _Quantized.__init__(layer)
        layer._settings("QuantizedEmbedding", group_size, bits, mode)
        layer._set_quantized(weight, scales, biases)
        layer.num_embeddings, layer.dims = int(weight.shape[0]), layer.packed_width
        layer._built = True
        layer.freeze()
        return layer

    def _extra_repr(self):
        return (f"{self.num_embeddings}, {self.dims}, group_size={self.group_size}, bits={self.bits}, "
                f"mode={self.mode}")

"""Dense layers: `Linear`, `LinearWithWeights`, `MulRows`."""

from __future__ import annotations

import mlx.core as mx

from .. import init as initializers
from ..data import Data, MTLSize
from .base import Layer


def float_dtype(dtype):
    """``dtype`` if it is a floating type, else float32 (parameters of a layer fed integers)."""
    return dtype if mx.issubdtype(dtype, mx.floating) else mx.float32


class Linear(Layer):
    """``y = x @ weight.T + bias`` over the W axis.

    Input dims ``(W=in_features, H, D)`` -> output ``(W=out_features, H, D)``; a plain array
    ``[..., in_features]`` gives ``[..., out_features]``. ``weight`` is ``[out_features, in_features]``
    (the PyTorch / Hugging Face / mlx.nn layout, so checkpoints load by name), ``bias``
    ``[out_features]``.

    Args:
        out_features: output width. The input width is taken from the first input; give
            ``in_features=`` to create the parameters now (``Linear(128, in_features=64)`` is
            mlx.nn's ``Linear(64, 128)``).
        bias: learn an additive bias.
        init: weight initializer (default U(-1/sqrt(in), 1/sqrt(in)), as mlx.nn and PyTorch).
        bias_init: bias initializer (default the same uniform).
        dtype: parameter dtype (default float32; a layer built at the first compile takes the
            input's floating dtype).
    """

    fixed_axes = ("W",)
    positional_hint = "{cls}({extra[0]}, in_features={out_features}) for mlx.nn's {cls}({out_features}, {extra[0]})"

    def __init__(self, out_features: int, *, in_features: int | None = None, bias: bool = True, init=None,
                 bias_init=None, dtype=None):
        super().__init__()
        if isinstance(out_features, bool) or not isinstance(out_features, int) or out_features <= 0:
            raise ValueError(f"Linear: out_features must be a positive int, got {out_features!r}")
        self.out_features = int(out_features)
        self.use_bias = bool(bias)
        self.init = initializers.get(init, initializers.FanInUniform())
        self.bias_init = initializers.get(bias_init, initializers.FanInUniform())
        self._dtype = dtype
        if in_features is not None:
            self._create(int(in_features), dtype or mx.float32, initializers.construction_key)
            self.mark_built(MTLSize(int(in_features)))

    def _create(self, in_features, dtype, next_key):
        self.in_features = in_features
        shape = (self.out_features, in_features)
        self.weight = self.init(shape, in_features, self.out_features, next_key(), dtype)
        if self.use_bias:
            self.bias = self.bias_init((self.out_features,), in_features, self.out_features, next_key(), dtype)

    def build(self, device, dims, dtype):
        self._create(dims.W, self._dtype or float_dtype(dtype), device.next_key)

    def forward(self, device, data):
        y = data.array @ self.weight.T
        if self.use_bias:
            y = y + self.bias
        d = data.dims
        return Data(y, MTLSize(self.out_features, d.H, d.D))

    def _extra_repr(self):
        return f"in_features={getattr(self, 'in_features', None)}, out_features={self.out_features}, bias={self.use_bias}"


class LinearWithWeights(Layer):
    """``y = x @ weight.T`` with a weight owned elsewhere (e.g. a tied embedding table).

    Args:
        weight_source: ``[out, in]`` ``mx.array``, a `Data` (its array is used), or a zero-argument
            callable returning the current weight (so it follows the owner's updates).
    """

    fixed_axes = ("W",)

    def __init__(self, weight_source):
        super().__init__()
        self._weight_source = weight_source

    def _weight(self):
        w = self._weight_source
        if callable(w):
            w = w()
        if isinstance(w, Data):
            w = w.array
        if w.ndim == 3 and w.shape[0] == 1:
            w = w[0]
        return w

    def forward(self, device, data):
        w = self._weight()
        self.require(w.shape[-1] == data.dims.W, f"input W={w.shape[-1]}", f"W={data.dims.W}")
        y = data.array @ w.T
        return Data(y, MTLSize(w.shape[0], data.dims.H, data.dims.D))


class MulRows(Layer):
    """Multiply every row by a learned per-feature vector ``weight[W]`` (initialised to ones)."""

    fixed_axes = ("W",)

    def __init__(self, *, init="ones"):
        super().__init__()
        self.init = initializers.get(init)

    def build(self, device, dims, dtype):
        self.weight = self.init((dims.W,), dims.W, dims.W, device.next_key(), float_dtype(dtype))

    def forward(self, device, data):
        return Data(data.array * self.weight, data.dims)

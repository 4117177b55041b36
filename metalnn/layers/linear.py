"""Dense layers: `Linear`, `LinearWithWeights`, `MulRows`."""

from __future__ import annotations

import mlx.core as mx

from .. import init as initializers
from ..data import Data, MTLSize
from ..layer import Layer


class Linear(Layer):
    """``y = x @ weight.T + bias`` over the W axis.

    Input dims ``(W=in_features, H, D)`` -> output ``(W=out_features, H, D)``. ``weight`` is
    ``[out_features, in_features]`` (the PyTorch / Hugging Face layout, so checkpoints load by name),
    ``bias`` is ``[out_features]``.

    Args:
        out_features: output width.
        bias: learn an additive bias (initialised to zero).
        init: weight initializer (default Xavier normal, as the seed library uses for linear layers).
        in_features: give it to create the parameters now instead of on the first compile.
    """

    fixed_axes = ("W",)

    def __init__(self, out_features: int, bias: bool = True, init="xavier_normal", in_features: int | None = None,
                 dtype=mx.float32, seed: int | None = None):
        super().__init__()
        if out_features <= 0:
            raise ValueError(f"Linear: out_features must be positive, got {out_features}")
        self.out_features = int(out_features)
        self.use_bias = bias
        self.init = initializers.get(init)
        self.seed = seed
        if in_features is not None:
            self._create(int(in_features), dtype, mx.random.key(seed or 0))
            self._built = True
            self._built_dims = MTLSize(int(in_features))

    def _create(self, in_features, dtype, key):
        self.in_features = in_features
        self.weight = self.init((self.out_features, in_features), in_features, self.out_features, key, dtype)
        if self.use_bias:
            self.bias = mx.zeros((self.out_features,), dtype=dtype)

    def build(self, device, dims, dtype):
        key = mx.random.key(self.seed) if self.seed is not None else device.next_key()
        self._create(dims.W, dtype if mx.issubdtype(dtype, mx.floating) else mx.float32, key)

    def forward(self, device, data):
        x = data.array
        y = x @ self.weight.T
        if self.use_bias:
            y = y + self.bias
        d = data.dims
        return Data(y, MTLSize(self.out_features, d.H, d.D))

    def _extra_repr(self):
        return f"out_features={self.out_features}, bias={self.use_bias}"


class LinearWithWeights(Layer):
    """``y = x @ weight.T`` with a weight owned elsewhere (e.g. a tied embedding table).

    Args:
        weight_data: ``[out, in]`` ``mx.array``, a `Data` (its array is used), or a zero-argument
            callable returning the current weight (so it follows the owner's updates).
    """

    fixed_axes = ("W",)

    def __init__(self, weight_data):
        super().__init__()
        self._weight_source = weight_data

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

    def __init__(self, init="ones"):
        super().__init__()
        self.init = initializers.get(init)

    def build(self, device, dims, dtype):
        self.weight = self.init((dims.W,), dims.W, dims.W, device.next_key(), dtype)

    def forward(self, device, data):
        return Data(data.array * self.weight, data.dims)
